"""`stream_options.continuous_usage_stats`: token counts in every streamed chunk, as vLLM sends them.

With it, each chunk of a streamed completion or chat completion carries `usage` for the choice the
chunk belongs to: the prompt's tokens, the tokens that choice has generated up to and including
this chunk, and their sum (vLLM's UsageInfo per chunk). The final usage-only chunk of
`include_usage` still sums the whole response. Chunks without a choice of their own (the final
usage chunk, errors) are unaffected.
"""

from __future__ import annotations

from typing import Any

from sits.runtime.engine.request import CompletionOutput, RequestOutput


def wants_continuous_usage(stream_options: Any) -> bool:
    """Whether the request's `stream_options` (None or a StreamOptions) asks for usage in every chunk."""
    return bool(stream_options is not None and getattr(stream_options, "continuous_usage_stats", False))


def running_usage(output: RequestOutput, choice: CompletionOutput, *, before_delta: bool = False) -> dict[str, Any]:
    """Usage of one choice so far: `{"prompt_tokens", "completion_tokens", "total_tokens",
    "prompt_tokens_details": {"cached_tokens"}}` (tokens).

    `before_delta`: count only the tokens generated before this output's delta (for the chunks
    that precede the delta's own, such as the assistant-role chunk).
    """
    prompt = len(output.prompt_token_ids)
    completion = len(choice.token_ids) - (len(choice.token_ids_delta) if before_delta else 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.metrics.num_cached_prompt_tokens}}
