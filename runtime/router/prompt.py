"""A request body -> the prefix block hashes its prompt will have on a replica.

Rendered, tokenized and hashed with the replicas' own code: their tokenizer and chat template
(`sits.runtime.models.tokenizer`, the same `--model` and `--chat-template`), their message mapping
(`sits.runtime.server.chat_render`), their request schemas (`sits.runtime.server.protocol`) and
the engine's hash chain (`sits.runtime.engine.prefix_hash`) with the tenant's salt from the
tenancy layer. A body the replicas would refuse hashes to nothing: it is routed by load and the
replica answers it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sits.runtime.config import ConfigError, read_chat_template
from sits.runtime.engine.prefix_hash import BlockHash, extend_block_hashes
from sits.runtime.models.chat_template import ChatTemplateError
from sits.runtime.models.embedded import embedded_gguf_path
from sits.runtime.models.errors import ModelLoadError
from sits.runtime.models.tokenizer import SPECIAL_TOKEN_NAMES, Tokenizer
from sits.runtime.server.chat_render import template_message
from sits.runtime.server.errors import OpenAIError
from sits.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class PromptKey:
    """What routing needs to know of one request's prompt.

    Attributes:
        block_hashes: hashes of the prompt's full blocks a replica could serve from its cache
            ((num_tokens - 1) // block_size of them, as the engine's `find_prefix`).
        num_tokens: prompt length in tokens.
    """

    block_hashes: tuple[BlockHash, ...]
    num_tokens: int


EMPTY_KEY = PromptKey((), 0)


def load_tokenizer(model: str | None, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer and chat template `sits serve --model MODEL --chat-template T` uses, torch-free.

    Raises:
        ConfigError: the model cannot be read, is an hf:// URI (give its local snapshot directory),
            or the chat template does not compile.
    """
    try:
        if model is None or model.lower().endswith(".gguf"):
            tokenizer = _gguf_tokenizer(embedded_gguf_path() if model is None else Path(model).expanduser())
        elif model.startswith("hf://"):
            raise ConfigError(f"--model {model}: give the router the snapshot directory of this repository "
                              "(the replicas' Hugging Face cache), not the hf:// URI")
        else:
            tokenizer = Tokenizer.from_directory(Path(model).expanduser())
    except ModelLoadError as error:
        raise ConfigError(str(error)) from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the tokenizer of --model {model}: {error}") from None
    if chat_template is not None:
        tokenizer = tokenizer.with_chat_template(read_chat_template(chat_template)[0])
    return tokenizer


def _gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer the replicas convert out of a GGUF file, rebuilt from its metadata only."""
    from sits.runtime.models.gguf_checkpoint import GGUFCheckpoint
    from sits.runtime.models.gguf_tokenizer import build_tokenizer

    if not path.is_file():
        raise ConfigError(f"model file {path} does not exist")
    rebuilt = build_tokenizer(GGUFCheckpoint.open(path).metadata)
    config = dict(rebuilt.config)
    template = config.pop("chat_template", None)
    special = {name: value if isinstance(value, str) else None
               for name, value in ((n, config.get(n)) for n in SPECIAL_TOKEN_NAMES)}
    return Tokenizer(rebuilt.tokenizer, special, template if isinstance(template, str) else None)


class PromptHasher:
    """Prefix block hashes of chat and completion bodies, as a replica would compute them.

    Args:
        tokenizer: the replicas' tokenizer (`load_tokenizer`).
        block_size: the replicas' --block-size, in tokens.
        served_model_name: the replicas' base model id (None: every model id is the base model);
            any other id is an adapter, whose name keys the hash chain as on the replicas.
    """

    def __init__(self, tokenizer: Tokenizer, block_size: int, served_model_name: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.served_model_name = served_model_name

    def prompt_ids(self, path: str, body: Any) -> tuple[list[int], str | None, bool] | None:
        """(prompt token ids, adapter name or None, shared_prefix) of a body; None when the
        replicas would refuse it or it has nothing to route on."""
        if not isinstance(body, dict):
            return None
        try:
            if path == CHAT_PATH:
                chat = ChatCompletionRequest.model_validate(body)
                chat.check_rendering()
                tools = [tool.model_dump(exclude_none=True) for tool in chat.tools] if chat.tools else None
                text = self.tokenizer.apply_chat_template([template_message(m) for m in chat.messages],
                                                          tools=tools, **chat.template_variables())
                ids = self.tokenizer.encode(text, add_special_tokens=chat.add_special_tokens)
                model, shared = chat.model, chat.shared_prefix
            elif path == COMPLETIONS_PATH:
                completion = CompletionRequest.model_validate(body)
                prompts = completion.prompts()
                if not prompts:
                    return None
                first = prompts[0]  # a batch goes to one replica: route on its first prompt
                ids = self.tokenizer.encode(first, add_special_tokens=True) if isinstance(first, str) else list(first)
                model, shared = completion.model, completion.shared_prefix
            else:
                return None
        except (ValidationError, OpenAIError, ChatTemplateError, ValueError, TypeError):
            return None
        lora = model if model and self.served_model_name and model != self.served_model_name else None
        return ids, lora, shared

    def key(self, token_ids: list[int], cache_salt: str | None, lora: str | None) -> PromptKey:
        """The hashes of the blocks a replica's `find_prefix` could hit for this prompt."""
        hashes: list[BlockHash] = []
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        extend_block_hashes(hashes, token_ids, self.block_size, max_blocks, cache_salt, lora)
        return PromptKey(tuple(hashes), len(token_ids))
