"""Pieces every OpenAI response shares: usage, server-sent events, finish reasons."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sits.runtime.engine.request import RequestOutput

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DONE = "data: [DONE]\n\n"


# One encoder for every event: json.dumps with non-default options builds a new one per call.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {_COMPACT_JSON.encode(payload)}\n\n"


def finish_text(reason: Any) -> str | None:
    """The engine's FinishReason as OpenAI spells it ("stop", "length"; "abort" when cut short)."""
    return None if reason is None else str(getattr(reason, "value", reason))


def usage(finals: Iterable[RequestOutput]) -> dict[str, Any]:
    """Token counts of the engine requests behind one response (a batch of prompts adds up)."""
    prompt = completion = cached = 0
    for final in finals:
        prompt += len(final.prompt_token_ids)
        completion += sum(len(choice.token_ids) for choice in final.outputs)
        cached += final.metrics.num_cached_prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
