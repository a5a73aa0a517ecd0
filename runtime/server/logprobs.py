"""Token logprobs in the two shapes of the OpenAI API.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`;
each top_logprobs entry holds the k most likely tokens and always the chosen one (up to k + 1, as
OpenAI documents). With echo the prompt's tokens come first, the first with null logprobs.
vLLM's `prompt_logprobs`: `[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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

    def completion(self, logprobs: Sequence[TokenLogprob], top_k: int, text_offset: int = 0) -> dict[str, Any]:
        """The legacy completions `choice.logprobs` for these positions, offsets counted from text_offset."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = text_offset
        for position in logprobs:
            text = self._tokenizer.token_to_text(position.token_id)
            tokens.append(text)
            token_logprobs.append(_finite(position.logprob))
            top = {self._tokenizer.token_to_text(token_id): _finite(lp) for token_id, lp in position.top[:top_k]}
            top.setdefault(text, _finite(position.logprob))
            top_logprobs.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def echoed_prompt(self, prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob | None],
                      top_k: int) -> dict[str, Any]:
        """The legacy `choice.logprobs` of an echoed prompt: its first token has null logprob and
        null top_logprobs (nothing precedes it); offsets start at 0."""
        first = self._tokenizer.token_to_text(prompt_token_ids[0])
        scored = [entry for entry in prompt_logprobs[1:] if entry is not None]
        rest = self.completion(scored, top_k, text_offset=len(first))
        return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}

    @staticmethod
    def end_offset(logprobs: dict[str, Any]) -> int:
        """The text offset just past a legacy logprobs object's last token."""
        if not logprobs["tokens"]:
            return 0
        return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])

    @staticmethod
    def joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
        """Two legacy logprobs objects as one (`then`'s offsets already follow `first`)."""
        return {key: [*first[key], *then[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    def vllm_prompt(self, prompt_logprobs: Sequence[TokenLogprob | None]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (null for the first) the token and its top k,
        keyed by token id, each with its logprob, rank (1 = most likely) and text."""
        result: list[dict[str, Any] | None] = []
        for entry in prompt_logprobs:
            if entry is None:
                result.append(None)
                continue
            ranked = {str(token_id): {"logprob": _finite(lp), "rank": rank,
                                      "decoded_token": self._tokenizer.token_to_text(token_id)}
                      for rank, (token_id, lp) in enumerate(entry.top, start=1)}
            ranked.setdefault(str(entry.token_id), {"logprob": _finite(entry.logprob), "rank": entry.rank,
                                                    "decoded_token": self._tokenizer.token_to_text(entry.token_id)})
            result.append(ranked)
        return result
