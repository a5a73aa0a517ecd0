"""Engine stats on demand: no step builds a snapshot unless someone asks, and an ask sees what the
per-step snapshot used to show.

The real engine over the tiny random Llama (SmolLM2's tokenizer), run by `AsyncEngine` on its
thread, by `EngineCore` over a real pipe on a thread, and by a spawned engine process behind
`MultiprocessEngineClient`. Builds are counted by wrapping `LLMEngine.stats` on the instance
(it still runs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine import core_wire as wire
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.core_client import MultiprocessEngineClient
from sits.runtime.engine.core_process import EngineCore
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.stats import EngineStats, StatsAnswers
from sits.runtime.server.metrics import ServerMetrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "The quick brown fox jumps over the lazy dog"
NEW_TOKENS = 6


def config(model: ModelConfig | None = None) -> EngineConfig:
    return EngineConfig(
        model=model or ModelConfig(device="cpu", dtype="float32", max_model_len=512),
        cache=CacheConfig(block_size=8, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class BuildCounter:
    """Wraps `engine.stats` on the instance: counts the snapshots built, and builds them as before."""

    def __init__(self, engine: LLMEngine) -> None:
        self.builds = 0
        self._build = engine.stats
        engine.stats = self  # type: ignore[method-assign]

    def __call__(self) -> EngineStats:
        self.builds += 1
        return self._build()


def figures(stats: EngineStats) -> EngineStats:
    """Everything but the clocks read when it was built (wall time, and the process's CPU time)."""
    return dataclasses.replace(stats, timestamp=0.0, cpu_seconds=0.0)


def exported(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    """The engine's series of one scrape: (sample name, tenant) -> value."""
    values = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name.startswith(("sits_requests_", "sits_kv_", "sits_prefix_", "sits_preemptions")):
                values[sample.name, sample.labels.get("tenant", "")] = sample.value
    return values


def per_step_reference(tiny, prompt: list[int]) -> EngineStats:
    """What the engine published after its last step before stats were built on demand: the same
    request run step by step, with a snapshot after every step."""
    engine = LLMEngine.from_loaded(tiny, config())
    engine.add_request("ref", prompt, greedy(NEW_TOKENS))
    snapshot = engine.stats()
    while engine.has_unfinished_requests():
        engine.step()
        snapshot = engine.stats()
    return snapshot


async def test_steps_build_no_snapshot_until_a_scrape_asks_and_it_sees_the_per_step_figures(tiny):
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(tiny, config()))
    counter = BuildCounter(engine.engine)
    metrics = ServerMetrics("tiny", "stable", engine.stats)
    await engine.start()
    try:
        prompt = tiny.tokenizer.encode(PROMPT)
        outputs = [output async for output in engine.generate(prompt, greedy(NEW_TOKENS), "r")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == NEW_TOKENS  # steps may merge
        assert counter.builds == 0, "a step built a stats snapshot nobody asked for"
        scraped = await asyncio.to_thread(exported, metrics)
        assert counter.builds == 1
        reference = per_step_reference(tiny, prompt)
        reference_metrics = ServerMetrics("tiny", "stable", lambda: reference)
        assert scraped == exported(reference_metrics)
        stats = engine.stats()
        assert figures(stats) == figures(reference)
        assert stats.num_finished == 1 and stats.num_generation_tokens == NEW_TOKENS and stats.num_requests == 0
        assert counter.builds == 2
    finally:
        await engine.shutdown()


async def test_an_ask_during_a_stream_sees_the_running_request(tiny):
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(tiny, config()))
    await engine.start()
    try:
        stream = engine.generate(tiny.tokenizer.encode(PROMPT), greedy(400), "long")
        first = await anext(stream)
        assert not first.finished
        stats = engine.stats()
        assert stats.num_running == 1 and stats.num_requests == 1 and stats.kv_blocks_used > 0
        assert stats.running_by_tenant == {"default": 1} and stats.kv_cache_usage > 0
        await stream.aclose()
        deadline = time.monotonic() + 10
        while engine.stats().num_requests:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert engine.stats().kv_blocks_used == 0 and engine.stats().num_aborted == 1
    finally:
        await engine.shutdown()
    assert engine.stats().num_aborted == 1  # the loop is gone: built by the caller


def receive_until(conn, done) -> list[wire.CoreBatch]:
    batches = []
    while not batches or not done(batches[-1]):
        assert conn.poll(30), "the engine core sent nothing for 30 s"
        batches.append(wire.decode(conn.recv_bytes()))
    return batches


def test_the_engine_core_sends_figures_only_in_answer_to_an_ask(tiny):
    engine = LLMEngine.from_loaded(tiny, config())
    counter = BuildCounter(engine)
    ours, theirs = multiprocessing.Pipe(duplex=True)
    core = EngineCore(engine, theirs)
    loop = threading.Thread(target=core.run, name="test-engine-core")
    loop.start()
    try:
        prompt = tiny.tokenizer.encode(PROMPT)
        ours.send_bytes(wire.encode([wire.AddRequest("r", prompt, greedy(NEW_TOKENS), "default", 0, None, True,
                                                     None)]))
        batches = receive_until(ours, lambda batch: any(wire.decode_output(output).finished for output in batch.outputs))
        assert counter.builds == 0 and all(batch.stats is None for batch in batches)
        ours.send_bytes(wire.encode([wire.StatsRequest(1), wire.StatsRequest(2)]))
        (answer,) = receive_until(ours, lambda batch: batch.stats is not None)
        assert answer.stats_ticket == 2 and counter.builds == 1  # one build answers both asks
        reference = per_step_reference(tiny, prompt)
        assert figures(answer.stats) == figures(reference)
    finally:
        ours.send_bytes(wire.encode([wire.Shutdown(0.0)]))
        receive_until(ours, lambda batch: batch.stopped)
        loop.join(30)
        ours.close()
        theirs.close()
    assert not loop.is_alive()


async def test_the_engine_process_answers_on_the_event_loop_in_command_order():
    dummy = ModelConfig(load_format="dummy", config_name="tiny", device="cpu", dtype="float32", max_model_len=512)
    client = MultiprocessEngineClient.spawn(config(dummy), log_level="warning")
    try:
        await client.start()
        stream = client.generate(list(range(3, 40)), greedy(400), "long")
        first = await anext(stream)
        assert not first.finished
        stats = client.stats()  # waits on the event loop's thread: the reader thread takes the answer
        assert stats.num_running == 1 and stats.num_requests == 1 and stats.kv_blocks_used > 0
        await stream.aclose()  # queues an abort; the next ask goes after it
        stats = client.stats()
        assert stats.num_requests == 0 and stats.num_aborted == 1 and stats.kv_blocks_used == 0
    finally:
        await client.shutdown()
    assert client.stats().num_aborted == 1  # the process is gone: its last answer


def test_stats_answers_answer_every_ticket_up_to_the_one_read_and_time_out_to_the_latest():
    initial, later = EngineStats(num_steps=1), EngineStats(num_steps=2)
    answers = StatsAnswers(initial)
    first, second = answers.ask(), answers.ask()
    assert (first, second) == (1, 2) and answers.pending == 2
    assert answers.wait(first, timeout_s=0.01) is initial  # no answer yet: the latest figures
    answers.answer(second, later)
    assert answers.pending == 0 and answers.wait(first) is later and answers.wait(second) is later
    third = answers.ask()
    waiter = threading.Thread(target=answers.close)
    waiter.start()
    assert answers.wait(third, timeout_s=30) is later  # closed: no answer will come
    waiter.join()
