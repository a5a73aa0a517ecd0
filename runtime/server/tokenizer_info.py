"""GET /tokenizer_info: the served tokenizer's configuration, as vLLM serves it.

vLLM answers with the fields of the model's `tokenizer_config.json` plus `tokenizer_class`.
Clients use it to tokenize on the server instead of downloading the tokenizer: with it,
lm-evaluation-harness's `local-completions` / `local-chat-completions` run with
`tokenizer_backend=remote` (or the default `auto`, which picks it when this route answers) and need
no Hub access. They read `eos_token`, `bos_token` and `pad_token` (strings, encoded through
`/tokenize`), and `chat_template` to render chats client-side.

The answer (every key always present except `chat_template`, absent when the model has none):

    {"tokenizer_class": str, "bos_token": str | null, "eos_token": str | null,
     "unk_token": str | null, "pad_token": str | null, "model_max_length": int (tokens),
     "chat_template": str}

With tenants it needs a key, like /tokenize; it runs no engine work.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI

from sits.runtime.models.tokenizer import SPECIAL_TOKEN_NAMES, Tokenizer
from sits.runtime.server.serving import ServingContext
from sits.runtime.server.tenant import request_tenant

# transformers loads the same tokenizer.json + tokenizer_config.json pair as this class
HF_FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The /tokenizer_info document of `tokenizer` (a Tokenizer, or a vocabulary-less test tokenizer)."""
    special = getattr(tokenizer, "special_tokens", None) or {}
    info: dict[str, Any] = {
        "tokenizer_class": HF_FAST_TOKENIZER_CLASS if isinstance(tokenizer, Tokenizer) else type(tokenizer).__name__,
        **{name: special.get(name) for name in SPECIAL_TOKEN_NAMES},
        "model_max_length": max_model_len,
    }
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


def install_tokenizer_info_route(app: FastAPI, ctx: ServingContext) -> None:
    """Add GET /tokenizer_info to `app`, describing `ctx`'s tokenizer (and chat template override)."""
    document = tokenizer_info(ctx.tokenizer, ctx.max_model_len)  # fixed for the server's life

    @app.get("/tokenizer_info", dependencies=[Depends(request_tenant)])
    async def get_tokenizer_info() -> dict[str, Any]:
        return document
