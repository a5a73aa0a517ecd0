"""vLLM's utility endpoints: POST /tokenize, POST /detokenize and GET /version, in vLLM's shapes.

- `/tokenize` takes either a `prompt` (text, tokenized as /v1/completions tokenizes it) or
  `messages` (rendered with the model's chat template exactly as /v1/chat/completions renders
  them, by the same code) and answers `{"count", "max_model_len", "tokens"}` (plus `token_strs`,
  the vocabulary spellings, when `return_token_strs` is true). A text may count more tokens than
  `max_model_len`: that is what clients ask to find out. Texts that no context could hold (see
  `ServingContext.max_prompt_chars`) are a 400 without the work of tokenizing them.
- `/detokenize` turns token ids back into text, special tokens included, so it round-trips.
- `/version` is the installed `sits` package's version.

None of them runs the engine: they are not admitted, rate limited or counted as generation
requests, though with tenants /tokenize and /detokenize need a key (`TenantGate`).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import Collection
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from sits.runtime.server.chat import ChatCompletions
from sits.runtime.server.errors import invalid_request
from sits.runtime.server.protocol import ChatMessage, ToolDefinition, validated_tools
from sits.runtime.server.protocol_base import StrictModel
from sits.runtime.server.protocol_chat import ChatTemplateOptions
from sits.runtime.server.serving import ServingContext

PACKAGE_NAME = "sits"
# Longer id lists are decoded in a worker thread, so a large /detokenize does not stall every
# other stream on the event loop (as `ServingContext.encode` does for long texts).
DECODE_INLINE_TOKENS = 4096


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`): one of the two.

    `add_special_tokens` defaults to true for a prompt (e.g. a BOS token, as /v1/completions adds)
    and to false for messages (the chat template writes its own markers).
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    tools: list[ToolDefinition] | None = None

    @field_validator("tools", mode="wrap")
    @classmethod
    def _tools(cls, value: Any, handler: Any) -> Any:
        return validated_tools(value, handler)

    def check_form(self) -> None:
        """400 unless exactly one of `prompt` and `messages` is given, with only the options we render."""
        if self.prompt is None and self.messages is None:
            raise invalid_request("Missing required parameter: 'prompt' (or 'messages' to tokenize a chat).",
                                  param="prompt", code="missing_required_parameter")
        if self.prompt is not None and self.messages is not None:
            raise invalid_request("Give either 'prompt' or 'messages', not both.", param="messages")


class DetokenizeRequest(StrictModel):
    """vLLM's DetokenizeRequest: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def installed_version() -> str:
    """The installed sits package's version ("unknown" when run from a tree that was never installed)."""
    try:
        return importlib.metadata.version(PACKAGE_NAME)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Tokenization:
    """The handlers of /tokenize and /detokenize over the served model's tokenizer.

    Args:
        ctx: the server's serving context (model name, tokenizer, max_model_len, text checks).
        chat: the chat endpoint, whose rendering of `messages` /tokenize reuses.
    """

    def __init__(self, ctx: ServingContext, chat: ChatCompletions) -> None:
        self.ctx = ctx
        self.chat = chat

    async def tokenize(self, body: TokenizeRequest, allowed: Collection[str] | None = None) -> JSONResponse:
        """`allowed`: the tenant's model allow-list (None: every served model; see `ServingContext.check_model`)."""
        self.ctx.check_model(body.model, allowed)
        body.check_form()
        if body.prompt is not None:
            add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
            token_ids = await self.ctx.encode(body.prompt, add_special_tokens=add_special_tokens, param="prompt")
        else:  # the chat form (check_form: messages are given)
            token_ids = await self.chat.prompt_token_ids(
                body.messages or [], body, add_special_tokens=bool(body.add_special_tokens), tools=body.tools)
        response: dict[str, Any] = {"count": len(token_ids), "max_model_len": self.ctx.max_model_len,
                                    "tokens": token_ids}
        if body.return_token_strs:
            response["token_strs"] = [self.ctx.tokenizer.id_to_token(token_id) for token_id in token_ids]
        return JSONResponse(response)

    async def detokenize(self, body: DetokenizeRequest, allowed: Collection[str] | None = None) -> JSONResponse:
        self.ctx.check_model(body.model, allowed)
        vocab_size = self.ctx.tokenizer.vocab_size
        bad = next((index for index, token_id in enumerate(body.tokens) if not 0 <= token_id < vocab_size), None)
        if bad is not None:
            raise invalid_request(f"token id {body.tokens[bad]} is out of range (vocabulary size {vocab_size})",
                                  param=f"tokens[{bad}]", code="invalid_value")
        if len(body.tokens) <= DECODE_INLINE_TOKENS:
            text = self._decode(body.tokens)
        else:
            text = await asyncio.to_thread(self._decode, body.tokens)
        return JSONResponse({"prompt": text})

    def _decode(self, token_ids: list[int]) -> str:
        # Special tokens stay in the text (as vLLM does), so tokenize -> detokenize gives the rendered prompt back.
        return self.ctx.tokenizer.decode(token_ids, skip_special_tokens=False)
