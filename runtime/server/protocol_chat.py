"""vLLM's request options for rendering a chat and for cutting long prompts, shared by the bodies
that take them (/v1/chat/completions, /tokenize; /v1/completions takes the truncation alone).

- `add_generation_prompt` (default true): end the prompt with the header of the assistant's turn.
- `continue_final_message`: leave the last message open for the model to continue (a prefilled
  assistant answer); exclusive with `add_generation_prompt`, as in transformers and vLLM.
- `chat_template_kwargs`: extra variables for the model's template (e.g. `enable_thinking`);
  the variables the server itself sets (messages, tools, ...) cannot be overridden.
- `documents`: retrieval documents (objects of strings) for templates that render them.
- `truncate_prompt_tokens`: keep only the last k tokens of the prompt; -1 keeps as many as fit.
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from sits.runtime.server.errors import invalid_request
from sits.runtime.server.protocol_base import StrictModel

# Variables the server passes to every template itself: a client's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now",
})
KEEP_ALL_THAT_FITS = -1


class ChatTemplateOptions(StrictModel):
    """How the conversation is rendered with the model's chat template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            taken = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(value))
            if taken:
                raise ValueError(f"{', '.join(taken)} cannot be set through chat_template_kwargs "
                                 "(the server sets them from the request)")
        return value

    def check_rendering(self) -> None:
        """400 for options that contradict each other (before any rendering work)."""
        if self.add_generation_prompt and self.continue_final_message:
            raise invalid_request("continue_final_message cannot be combined with add_generation_prompt; "
                                  "set add_generation_prompt to false", "continue_final_message")

    def template_variables(self) -> dict[str, Any]:
        """Keyword arguments for `Tokenizer.apply_chat_template`."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "documents": self.documents, **(self.chat_template_kwargs or {})}


class PromptTruncation(StrictModel):
    """vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: as many as fit)."""

    truncate_prompt_tokens: int | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _positive_or_all(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != KEEP_ALL_THAT_FITS:
            raise ValueError(f"truncate_prompt_tokens must be at least 1, or -1 to keep as many tokens as fit, "
                             f"got {value}")
        return value

    def truncated(self, token_ids: list[int], room: int) -> list[int]:
        """The prompt's last tokens: k of them, or with -1 the most that leave `room` to generate
        within the context (the caller passes max_model_len minus the tokens to generate)."""
        if self.truncate_prompt_tokens is None:
            return token_ids
        keep = room if self.truncate_prompt_tokens == KEEP_ALL_THAT_FITS else self.truncate_prompt_tokens
        return token_ids[-max(keep, 1):]
