"""The engine process's wire format: snapshots sent as deltas come back exactly as they were sent,
also when a field did not simply grow (a stop string cut the text, text held until the end)."""

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


def snapshot(texts: list[tuple[str, str]], tokens: list[tuple[list[int], list[int]]], finished: bool = False,
             reasons: tuple = (None, None), prompt_logprobs=None, logprobs=None) -> RequestOutput:
    outputs = []
    for index, ((text, text_delta), (ids, ids_delta)) in enumerate(zip(texts, tokens, strict=True)):
        lp, lp_delta = (logprobs or {}).get(index, (None, None))
        outputs.append(CompletionOutput(index=index, text=text, token_ids=ids, text_delta=text_delta,
                                        token_ids_delta=ids_delta, logprobs=lp, logprobs_delta=lp_delta,
                                        cumulative_logprob=-0.5 * len(ids), finish_reason=reasons[index]))
    return RequestOutput("req", list(PROMPT), outputs, finished, RequestMetrics(arrival_time=1.0), "acme",
                         prompt_logprobs)


def round_trip(snapshots: list[RequestOutput]) -> list[RequestOutput]:
    encoder, decoder = wire.OutputEncoder(), wire.OutputDecoder("req", list(PROMPT), "acme")
    return [decoder.decode(pickle.loads(wire.encode(encoder.encode(s)))) for s in snapshots]


def test_growing_snapshots_come_back_identical_and_the_prompt_is_not_sent():
    lp = [TokenLogprob(7, -0.1, [(7, -0.1)]), TokenLogprob(8, -0.2, [(8, -0.2)])]
    prompt_lp = [None, TokenLogprob(5, -1.0, [], rank=1), TokenLogprob(9, -2.0, [], rank=3),
                 TokenLogprob(14, -0.3, [], rank=1)]
    snapshots = [
        snapshot([("He", "He"), ("A", "A")], [([7], [7]), ([3], [3])], prompt_logprobs=prompt_lp,
                 logprobs={0: (lp[:1], lp[:1])}),
        snapshot([("Hello", "llo"), ("A", "")], [([7, 8], [8]), ([3], [])], prompt_logprobs=prompt_lp,
                 logprobs={0: (lp, lp[1:])}),
        snapshot([("Hello", ""), ("Ab", "b")], [([7, 8], []), ([3, 4], [4])], True,
                 (FinishReason.STOP, FinishReason.LENGTH), prompt_lp, logprobs={0: (lp, [])}),
    ]
    assert round_trip(snapshots) == snapshots
    encoder = wire.OutputEncoder()
    first, second = (encoder.encode(s) for s in snapshots[:2])
    assert first.prompt_logprobs == prompt_lp and second.prompt_logprobs is None  # sent once
    assert PROMPT[-1] not in [t for c in second.completions for t in c.token_ids_delta]
    assert all(c.full_text is None and c.full_token_ids is None for c in second.completions)


def test_a_text_cut_by_a_stop_string_and_a_text_held_to_the_end_are_sent_whole():
    snapshots = [
        snapshot([("The end", "The end")], [([4, 5], [4, 5])], reasons=(None,)),
        snapshot([("The", "")], [([4, 5, 6], [6])], True, (FinishReason.STOP,)),  # " end" was a stop string
    ]
    assert round_trip(snapshots) == snapshots
    held = [  # stream_text=False: no text until the final snapshot, which carries it all
        snapshot([("", "")], [([4], [4])], reasons=(None,)),
        snapshot([("", "")], [([4, 5], [5])], reasons=(None,)),
        snapshot([("Hi there", "Hi there")], [([4, 5, 6], [6])], True, (FinishReason.LENGTH,)),
    ]
    assert round_trip(held) == held


def test_an_aborted_request_keeps_what_it_had_and_ends_with_abort():
    decoder = wire.OutputDecoder("req", list(PROMPT), "acme")
    encoder = wire.OutputEncoder()
    decoder.decode(encoder.encode(snapshot([("Hi", "Hi"), ("Yo", "Yo")], [([4], [4]), ([6], [6])])))
    final = decoder.aborted()
    assert final.finished and final.prompt_token_ids == PROMPT
    assert [(c.text, c.token_ids, c.finish_reason) for c in final.outputs] == [
        ("Hi", [4], FinishReason.ABORT), ("Yo", [6], FinishReason.ABORT)]


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
