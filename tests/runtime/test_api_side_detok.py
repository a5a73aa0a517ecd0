"""Detokenization and stop strings on the client's side of the engine (`RequestStream`), in both modes.

The engine sends token deltas; `AsyncEngine` (in-process) and `MultiprocessEngineClient` (the engine
process) decode them and apply stop strings in the same code. Their outputs must equal what the
offline `LLMEngine` (which still decodes itself) gives, a stop string must stop the engine's sequence
at once (n = 2: only that completion), and a consumer that falls behind gets the steps it missed
merged into one snapshot that carries every token and character exactly once.

Runs the tiny random GQA Llama (real model code, SmolLM2's tokenizer): its text is gibberish, but
real tokens, so stop strings are picked from what it generates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.core_client import MultiprocessEngineClient
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import CompletionOutput, FinishReason, RequestOutput, SamplingParams
from sits.runtime.engine.request_stream import RequestStream

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog"
# The tokens an engine may add after the one that completed a stop string, before the client's abort reaches it: the
# abort crosses from the client to the engine (another process, or another task), and the tiny model's steps take
# about a millisecond, so a client descheduled for a few ms on a loaded 2-core machine sees the engine add several
# (4 once in CI, on 2026-12-04). Far below the 200 tokens it would run on to without the abort.
RUN_ON = 8
# One engine of each kind (and one event loop) for the module: every test waits until its requests have left
# the engine, and measures the engine's counters as differences.
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.asyncio(loop_scope="module")]


def config(model: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, device="cpu", dtype="float32", max_model_len=512),
        cache=CacheConfig(block_size=8, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["in-process", "engine-process"])
async def client(request, tiny, tiny_llama_dir) -> AsyncIterator[AsyncEngine | MultiprocessEngineClient]:
    if request.param == "in-process":
        engine: AsyncEngine | MultiprocessEngineClient = AsyncEngine.from_engine(LLMEngine.from_loaded(tiny, config()))
    else:
        engine = MultiprocessEngineClient.spawn(config(str(tiny_llama_dir)), log_level="warning")
        engine.event_loop_niceness = 0  # the test process's own thread: leave its priority to the later tests
    await engine.start()
    yield engine
    await engine.shutdown()


def offline(tiny, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """The final output of the offline engine, which decodes and applies stop strings itself."""
    engine = LLMEngine.from_loaded(tiny, config())
    engine.add_request("ref", prompt, params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None
    return final


async def run(client, prompt: list[int], params: SamplingParams, request_id: str) -> list[RequestOutput]:
    return [output async for output in client.generate(prompt, params, request_id)]


async def settled(client, timeout_s: float = 30.0) -> None:
    """Until the engine holds no request and no KV block."""
    deadline = time.monotonic() + timeout_s
    while client.stats().num_requests or client.stats().kv_blocks_used:
        assert time.monotonic() < deadline, "the engine still holds the request"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)  # the deliveries the engine queued on this loop before it answered run now


def stop_string_in(text: str, avoid: str = "") -> str:
    """A short piece from the middle of `text` (not blank, not in `avoid`) to use as a stop string."""
    for start in range(len(text) // 3, len(text) - 6):
        piece = text[start:start + 5]
        if piece.strip() and piece not in avoid:
            return piece
    raise AssertionError(f"no stop string found in {text!r}")


def summary(c: CompletionOutput) -> tuple:
    return c.text, c.token_ids, c.finish_reason, c.stop_reason


async def test_a_stop_string_ends_the_completion_like_offline_and_stops_the_engine_at_once(client, tiny):
    prompt = client.tokenizer.encode(PROMPT_TEXT)
    free_run = offline(tiny, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stop = stop_string_in(free_run.outputs[0].text)
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        expected = offline(tiny, prompt, params).outputs[0]
        assert expected.finish_reason is FinishReason.STOP and expected.stop_reason == stop
        before = client.stats().num_generation_tokens
        outputs = await run(client, prompt, params, f"stop-{include}")
        final = outputs[-1].outputs[0]
        assert summary(final) == summary(expected)
        assert "".join(o.outputs[0].text_delta for o in outputs) == expected.text
        await settled(client)  # the engine stopped the sequence and freed its blocks
        generated = client.stats().num_generation_tokens - before
        assert generated <= len(expected.token_ids) + RUN_ON, "the engine ran on past the stop string"


async def test_n2_a_stop_string_stops_only_the_completion_it_ended(client, tiny):
    prompt = client.tokenizer.encode(PROMPT_TEXT)
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=64, ignore_eos=True)
    free_run = offline(tiny, prompt, sampled).outputs
    stop = stop_string_in(free_run[0].text[:60], avoid=free_run[1].text)
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=64, ignore_eos=True, stop=[stop])
    expected = offline(tiny, prompt, params).outputs[0]
    before = client.stats().num_generation_tokens
    outputs = await run(client, prompt, params, "n2")
    first, second = sorted(outputs[-1].outputs, key=lambda c: c.index)
    assert summary(first) == summary(expected)
    assert (second.finish_reason, len(second.token_ids)) == (FinishReason.LENGTH, 64)
    ended_first = next(i for i, o in enumerate(outputs) if o.outputs[0].finished)
    assert any(not o.outputs[1].finished for o in outputs[ended_first:])  # the other one went on
    await settled(client)
    generated = client.stats().num_generation_tokens - before
    assert generated <= len(first.token_ids) + 64 + RUN_ON, "the stopped completion kept running in the engine"


async def test_a_consumer_that_falls_behind_gets_the_missed_steps_merged_once(client, tiny):
    prompt = client.tokenizer.encode(PROMPT_TEXT)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    expected = offline(tiny, prompt, params).outputs[0]
    stream = client.generate(prompt, params, "slow")
    outputs = [await anext(stream)]
    await settled(client)  # every step happened while this consumer read nothing
    outputs += [output async for output in stream]
    assert len(outputs) == 2 and outputs[-1].finished  # the missed steps came as one snapshot
    assert "".join(o.outputs[0].text_delta for o in outputs) == expected.text
    assert [t for o in outputs for t in o.outputs[0].token_ids_delta] == expected.token_ids
    assert [lp.token_id for o in outputs for lp in o.outputs[0].logprobs_delta] == expected.token_ids
    assert summary(outputs[-1].outputs[0]) == summary(expected)


class Letters:
    """Token i decodes to the i-th lowercase letter: text as predictable as the tokens."""

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


def step(index: int, tokens: list[int], reason: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", [], [CompletionOutput(index=index, token_ids_delta=tokens, finish_reason=reason)], False)


async def test_a_stop_string_across_tokens_is_held_back_then_cut_and_reported_once():
    stream = RequestStream("r", [0], SamplingParams(n=2, stop=["cd"]), "t", True, Letters())
    assert stream.add(step(0, [1, 2])) == []  # "bc": "c" could start the stop string, held back
    assert (await stream.next()).outputs[0].text == "b"
    assert stream.add(step(1, [4])) == []
    assert stream.add(step(0, [3])) == [0]  # "bcd": the stop string; the engine is told once
    assert stream.add(step(0, [4])) == []  # what the engine made before it heard is dropped
    merged = await stream.next()  # both completions' steps since the last read, in one snapshot
    assert [(c.text, c.text_delta, c.finish_reason) for c in merged.outputs] == [
        ("b", "", FinishReason.STOP), ("e", "e", None)]
    assert merged.outputs[0].stop_reason == "cd" and merged.outputs[0].token_ids == [1, 2, 3]
    assert not merged.finished
    stream.add(step(1, [5], FinishReason.LENGTH))
    final = await stream.next()
    assert final.finished and stream.done and final.outputs[1].text == "ef"
