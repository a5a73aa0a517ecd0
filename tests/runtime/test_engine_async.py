"""AsyncEngine: streaming, concurrency, aborts that free blocks at once, drain, and step failures.

Runs the tiny random GQA Llama (real weights loading and model code, SmolLM2's tokenizer).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineShuttingDownError,
    PromptTooLongError,
)
from sits.runtime.engine.request import FinishReason, SamplingParams
from sits.runtime.models.loading import LoadedModel

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "1 2 3 4 5 6 7 8 9 10 11 12"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32", max_model_len=512),
        cache=CacheConfig(block_size=8, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )


@pytest.fixture
async def engine(tiny):
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(tiny, config()))
    await engine.start()
    yield engine
    await engine.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str):
    outputs = []
    async for output in engine.generate(prompt, params, request_id):
        outputs.append(output)
    return outputs


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def sync_greedy(tiny: LoadedModel, prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine.from_loaded(tiny, config())
    engine.add_request("ref", prompt, greedy(max_tokens))
    last = None
    while engine.has_unfinished_requests():
        last = next(iter(engine.step()), last)
    return last.outputs[0].token_ids


async def test_generate_streams_each_step_and_matches_the_sync_engine(engine, tiny):
    prompt = tiny.tokenizer.encode(PROMPTS[1])
    outputs = await collect(engine, prompt, greedy(6), "stream")
    # one snapshot per step while the consumer keeps up; steps it fell behind on arrive merged into one
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    deltas = [len(o.outputs[0].token_ids_delta) for o in outputs]
    assert all(n >= 1 for n in deltas) and sum(deltas) == 6
    final = outputs[-1].outputs[0]
    assert final.token_ids == sync_greedy(tiny, prompt, 6)
    assert "".join(o.outputs[0].text_delta for o in outputs) == final.text
    assert outputs[0] is not outputs[1] and outputs[0].outputs[0].token_ids == final.token_ids[:deltas[0]]  # snapshots


async def test_concurrent_requests_are_batched_and_each_gets_its_own_tokens(engine, tiny):
    prompts = [tiny.tokenizer.encode(p) for p in PROMPTS]
    results = await asyncio.gather(*(collect(engine, p, greedy(5 + i), f"c{i}") for i, p in enumerate(prompts)))
    for i, (prompt, outputs) in enumerate(zip(prompts, results, strict=True)):
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == sync_greedy(tiny, prompt, 5 + i)
    stats = engine.stats()
    assert stats.num_finished == 3 and stats.num_generation_tokens == 5 + 6 + 7


async def test_leaving_the_stream_early_aborts_and_frees_its_blocks(engine, tiny):
    prompt = tiny.tokenizer.encode(PROMPTS[2])
    async with contextlib.aclosing(engine.generate(prompt, greedy(400), "leaver")) as stream:
        async for output in stream:
            assert not output.finished
            break
    await wait_until(lambda: engine.stats().num_requests == 0)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_aborted == 1


async def test_a_cancelled_consumer_aborts_its_request(engine, tiny):
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(tiny.tokenizer.encode(PROMPTS[0]), greedy(400), "cancelled"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine.stats().num_requests == 0)
    assert engine.stats().kv_blocks_used == 0 and engine.stats().num_aborted == 1


async def test_abort_ends_the_stream_with_finish_reason_abort(engine, tiny):
    stream = engine.generate(tiny.tokenizer.encode(PROMPTS[0]), greedy(400), "to-abort")
    first = await anext(stream)
    assert not first.finished
    await engine.abort("to-abort")
    rest = [output async for output in stream]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason is FinishReason.ABORT
    await wait_until(lambda: engine.stats().kv_blocks_used == 0)


async def test_bad_requests_raise_before_anything_is_queued(engine):
    with pytest.raises(PromptTooLongError):
        await anext(engine.generate([], SamplingParams(), "empty"))
    with pytest.raises(PromptTooLongError):
        await anext(engine.generate([5] * 510, SamplingParams(max_tokens=10), "long"))
    assert engine.stats().num_requests == 0 and engine.is_healthy


async def test_idle_loop_sleeps_instead_of_polling(engine, tiny):
    await collect(engine, tiny.tokenizer.encode(PROMPTS[0]), greedy(2), "warm")
    before = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - before < 0.1  # a busy loop would burn ~0.5 s of CPU here


class InstrumentedModel(torch.nn.Module):
    """The real model, with a floor on each forward's duration (so step counts map to wall time)
    and a switch that makes it raise: a device fault in the middle of serving."""

    def __init__(self, model, seconds_per_step: float = 0.0) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.seconds_per_step = seconds_per_step
        self.fail = False

    def forward(self, *args):
        if self.fail:
            raise RuntimeError("simulated device fault")
        time.sleep(self.seconds_per_step)
        return self.inner(*args)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


def serving(tiny: LoadedModel, model: InstrumentedModel) -> AsyncEngine:
    loaded = LoadedModel(model, tiny.tokenizer, tiny.config, tiny.name, tiny.source, tiny.device, tiny.dtype)
    return AsyncEngine.from_engine(LLMEngine.from_loaded(loaded, config()))


async def test_shutdown_drains_in_flight_requests_then_aborts_the_rest(tiny):
    engine = serving(tiny, InstrumentedModel(tiny.model, seconds_per_step=0.01))
    await engine.start()
    prompt = tiny.tokenizer.encode(PROMPTS[0])
    started = {"short": asyncio.Event(), "endless": asyncio.Event()}

    async def collect_and_signal(params: SamplingParams, request_id: str):
        outputs = []
        async for output in engine.generate(prompt, params, request_id):
            outputs.append(output)
            started[request_id].set()
        return outputs

    # Both admitted and streaming; short needs 8 steps (>= 0.08 s), endless 500 (>= 5 s), so the
    # 2 s drain lets short finish and must abort endless.
    short = asyncio.create_task(collect_and_signal(greedy(8), "short"))
    endless = asyncio.create_task(collect_and_signal(greedy(500), "endless"))
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started.values())), 10)
    await engine.shutdown(drain_timeout_s=2.0)
    short_outputs, endless_outputs = await asyncio.wait_for(asyncio.gather(short, endless), 10)
    assert short_outputs[-1].outputs[0].finish_reason is FinishReason.LENGTH
    assert len(short_outputs[-1].outputs[0].token_ids) == 8
    assert endless_outputs[-1].outputs[0].finish_reason is FinishReason.ABORT
    assert engine.stats().kv_blocks_used == 0
    with pytest.raises(EngineShuttingDownError):
        await anext(engine.generate(prompt, greedy(1), "late"))


async def test_a_failing_step_fails_in_flight_requests_and_marks_the_engine_unhealthy(tiny):
    failing = InstrumentedModel(tiny.model)
    engine = serving(tiny, failing)
    await engine.start()
    try:
        stream = engine.generate(tiny.tokenizer.encode(PROMPTS[0]), greedy(400), "doomed")
        await anext(stream)
        failing.fail = True
        with pytest.raises(EngineError, match="simulated device fault"):
            async for _ in stream:
                pass
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(tiny.tokenizer.encode(PROMPTS[0]), greedy(1), "after"))
    finally:
        await engine.shutdown()
