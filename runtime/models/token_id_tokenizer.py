"""`TokenIdTokenizer`: the tokenizer of models with random weights and no vocabulary.

Its own module, free of torch: the engine process sends the tokenizer to the API server by pickle,
and unpickling imports the class's module, so the API server never imports torch for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenIdTokenizer:
    """Text ↔ token ids for models without a vocabulary: ids written as space-separated numbers.

    A full server tokenizer (what /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
    logprobs and structured outputs call), so `sits serve --load-format dummy` serves random weights:
      - encode: "17 42 9" → [17, 42, 9] (any whitespace between ids); anything else is an
        InvalidRequestError (a 400 naming the prompt);
      - decode: [17, 42, 9] → " 17 42 9": every token is its id after one space, so a streamed
        answer is the ids separated by spaces, and decoding a list is the join of its tokens;
      - chat: the rendered prompt is the messages' contents (each itself token ids as text) joined
        by spaces, in order; roles add no tokens (`apply_chat_template`), so a chat request's prompt
        tokens are exactly the ids its messages hold. A message with anything but ids is a 400.

    Args:
        vocab_size: ids are 0 .. vocab_size - 1.
        eos_token_ids: ids that end generation (and that skip_special_tokens drops).
    """

    chat_template = "token ids: the messages' contents joined by spaces"

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_token_id = min(self.eos_token_ids) if self.eos_token_ids else None
        self.bos_token_id: int | None = None
        self.all_special_ids = self.eos_token_ids
        self.special_tokens: dict[str, str | None] = {
            "bos_token": None, "unk_token": None, "pad_token": None,
            "eos_token": str(self.eos_token_id) if self.eos_token_id is not None else None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """'17 4021' → [17, 4021]; raises InvalidRequestError (a ValueError) on anything but ids in the vocabulary."""
        from sits.runtime.engine.errors import InvalidRequestError

        try:
            ids = [int(part) for part in text.split()]
        except ValueError:
            raise InvalidRequestError("the model has dummy weights and no vocabulary: a text prompt must be token "
                                      f"ids separated by spaces, such as '17 42 9'; got {text[:40]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of range (vocabulary {self.vocab_size}): {bad[:5]}")
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(text, add_special_tokens) for text in texts]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(t)}" for t in token_ids
                       if not (skip_special_tokens and int(t) in self.eos_token_ids))

    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes one token decodes to (" 17"); b"" outside the vocabulary."""
        return f" {token_id}".encode() if 0 <= token_id < self.vocab_size else b""

    def token_to_text(self, token_id: int) -> str:
        return self.token_to_bytes(token_id).decode()

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry: the id itself ("17"); None outside the vocabulary."""
        return str(token_id) if 0 <= token_id < self.vocab_size else None

    def token_to_id(self, token: str) -> int | None:
        try:
            token_id = int(token)
        except ValueError:
            return None
        return token_id if 0 <= token_id < self.vocab_size else None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The messages' contents joined by spaces (each content token ids as text; parts' texts joined).

        Raises:
            ChatTemplateError: a message holds something other than token ids (a 400 naming messages).
        """
        from sits.runtime.models.chat_template import ChatTemplateError

        texts = []
        for index, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list):
                content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
            text = content if isinstance(content, str) else ""
            if not all(part.isdigit() for part in text.split()):
                raise ChatTemplateError(f"the model has dummy weights and no vocabulary: message {index}'s "
                                        "content must be token ids separated by spaces, such as '17 42 9'")
            texts.append(text.strip())
        return " ".join(text for text in texts if text)

    def with_chat_template(self, chat_template: str | None) -> TokenIdTokenizer:
        return self
