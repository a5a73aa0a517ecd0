"""The engine process's wire format: the engine's token-delta snapshots come back exactly as they
were sent, the prompt logprobs once per request; errors keep the class that picks the HTTP status."""

from __future__ import annotations

import pickle

from sits.runtime.engine import core_wire as wire
from sits.runtime.engine.errors import EngineShuttingDownError, PromptTooLongError
from sits.runtime.engine.request import (
    CompletionOutput,
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParamsError,
    TokenLogprob,
)
from sits.runtime.engine.structured_output import StructuredOutputError

PROMPT = [1, 5, 9, 14]


def step(deltas: list[tuple[list[int], FinishReason | None]], finished: bool = False, prompt_logprobs=None,
         logprobs: dict | None = None, stop_reason=None) -> RequestOutput:
    """A token-delta snapshot as `OutputProcessor(detokenize=False)` makes it."""
    outputs = [CompletionOutput(index=index, token_ids_delta=ids, logprobs_delta=(logprobs or {}).get(index),
                                finish_reason=reason, stop_reason=stop_reason if reason else None)
               for index, (ids, reason) in enumerate(deltas)]
    metrics = RequestMetrics(arrival_time=1.0, first_token_time=2.5, num_cached_prompt_tokens=3)
    return RequestOutput("req", [], outputs, finished, metrics, prompt_logprobs=prompt_logprobs)


def test_token_deltas_come_back_identical_and_the_prompt_logprobs_are_sent_once():
    lp = [TokenLogprob(7, -0.1, [(7, -0.1)]), TokenLogprob(8, -0.2, [(8, -0.2)], rank=2)]
    prompt_lp = [None, TokenLogprob(5, -1.0, [], rank=1), TokenLogprob(9, -2.0, [], rank=3),
                 TokenLogprob(14, -0.3, [], rank=1)]
    steps = [step([([7], None), ([3], None)], prompt_logprobs=prompt_lp, logprobs={0: lp[:1]}),
             step([([8], FinishReason.STOP), ([4, 6], None)], prompt_logprobs=prompt_lp, logprobs={0: lp[1:]},
                  stop_reason=2),
             step([([], None), ([9], FinishReason.LENGTH)], True, prompt_logprobs=prompt_lp)]
    encoder = wire.OutputEncoder()
    back = [wire.decode_output(pickle.loads(wire.encode(encoder.encode(s)))) for s in steps]
    assert back[0] == steps[0]
    assert [b.prompt_logprobs for b in back[1:]] == [None, None]  # the same list each step: sent once
    assert [b.outputs for b in back] == [s.outputs for s in steps]
    assert all(b.metrics == steps[0].metrics for b in back)
    assert all(type(c.finish_reason) is FinishReason for b in back for c in b.outputs if c.finish_reason)
    # a finished request is forgotten: a new one of the same id gets them again
    assert encoder.encode(step([([1], None)], prompt_logprobs=prompt_lp))[4] == prompt_lp
    assert encoder.encode(step([([1], None)], prompt_logprobs=prompt_lp))[4] is None


def test_errors_keep_the_class_that_picks_the_http_status():
    for error in (SamplingParamsError("temperature", "temperature must be >= 0"),
                  StructuredOutputError("bad schema", "response_format"),
                  PromptTooLongError("too long"), EngineShuttingDownError("stopping"), ValueError("odd")):
        back = wire.error_from_wire(pickle.loads(wire.encode(wire.wire_error(error))))
        assert str(back) == str(error)
        assert isinstance(back, ValueError) == isinstance(error, ValueError)
        if isinstance(error, SamplingParamsError):
            assert isinstance(back, SamplingParamsError) and back.param == error.param
    assert isinstance(wire.error_from_wire(wire.wire_error(PromptTooLongError("x"))), PromptTooLongError)
