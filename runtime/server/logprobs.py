"""Token logprobs in the two shapes of the OpenAI API.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
"""

from __future__ import annotations

import math
from typing import Any

from sits.runtime.engine.request import TokenLogprob

FLOOR = -9999.0  # JSON has no -inf; a masked token's logprob is reported as this


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class LogprobFormatter:
    """Formats engine TokenLogprobs with a tokenizer's token text and bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self._tokenizer.token_to_text(token_id), "logprob": _finite(logprob),
                "bytes": list(self._tokenizer.token_to_bytes(token_id))}

    def chat(self, logprobs: list[TokenLogprob], top_k: int) -> dict[str, Any]:
        """The chat `choice.logprobs` object for these positions; top_k alternatives each."""
        content = []
        for position in logprobs:
            entry = self._entry(position.token_id, position.logprob)
            entry["top_logprobs"] = [self._entry(token_id, lp) for token_id, lp in position.top[:top_k]]
            content.append(entry)
        return {"content": content, "refusal": None}

    def completion(self, logprobs: list[TokenLogprob], top_k: int, text_offset: int = 0) -> dict[str, Any]:
        """The legacy completions `choice.logprobs` for these positions, offsets counted from text_offset."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = text_offset
        for position in logprobs:
            text = self._tokenizer.token_to_text(position.token_id)
            tokens.append(text)
            token_logprobs.append(_finite(position.logprob))
            top_logprobs.append({self._tokenizer.token_to_text(token_id): _finite(lp)
                                 for token_id, lp in position.top[:top_k]})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
