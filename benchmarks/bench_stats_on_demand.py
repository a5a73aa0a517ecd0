"""What the engine's stats cost, now that they are built when asked rather than after every step.

Until stats were built on demand, the serving loop (`AsyncEngine`'s thread, the engine process's
loop) called `LLMEngine.stats()` after every step and every batch of commands: a Counter over every
running and waiting sequence per tenant, dict copies of the per-tenant figures, and, across the
process boundary, pickling the snapshot into every step's batch. This measures, on the real engine
over the `tiny` Llama at batch 1 / 32 / 256 with ~`context`-token sequences in steady decode (the
set-up of `bench_engine_host_overhead.py`):

    build     µs of thread CPU time per `LLMEngine.stats()` (median of `--repeats`): what every
              decode step paid before, and what one ask pays now
    pickle    µs to pickle that snapshot (what every CoreBatch carried across the pipe before)

and, with `--round-trip`, the wall time of one ask through a spawned engine process
(`MultiprocessEngineClient.stats()`): idle, and while it decodes `--busy-batch` sequences (the ask
waits for the step in flight).

    python benchmarks/bench_stats_on_demand.py [--batches 1 32 256] [--tenants 4] [--round-trip]

Runs against whichever engine `sits` imports, so the same file measures an older checkout too.
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import statistics
import sys
import time

import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.models.presets import preset_config
from sits.runtime.models.random_model import random_loaded_model

BLOCK_SIZE = 16
WARMUP_STEPS = 4


def steady_engine(loaded, batch: int, context: int, tenants: int) -> LLMEngine:
    """An engine with `batch` sequences of ~context tokens each, decoding (prompts share all but
    their last block, so one prefill serves the rest through the prefix cache)."""
    total_new = WARMUP_STEPS + 64
    blocks_per_seq = -(-(context + total_new) // BLOCK_SIZE)
    config = EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32", max_model_len=context + total_new + BLOCK_SIZE),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks_per_seq + batch * (4 + total_new // BLOCK_SIZE)),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, context + BLOCK_SIZE)),
    )
    engine = LLMEngine.from_loaded(loaded, config)
    generator = torch.Generator().manual_seed(batch)
    prompt_len = context - WARMUP_STEPS
    shared = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    common = torch.randint(3, loaded.config.vocab_size, (shared,), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=total_new, ignore_eos=True)
    for index in range(batch):
        tail = torch.randint(3, loaded.config.vocab_size, (prompt_len - shared,), generator=generator).tolist()
        engine.add_request(f"r{index}", common + tail, params, tenant=f"tenant-{index % tenants}")
        while index == 0 and not engine.step():  # its prefill caches the shared blocks
            pass
    while engine.stats().num_waiting or engine.stats().num_running < batch:
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    return engine


def build_costs(engine: LLMEngine, repeats: int) -> tuple[float, float, int]:
    """(median µs per stats() build, median µs to pickle it, pickled bytes), in thread CPU time."""
    builds, pickles = [], []
    for _ in range(repeats):
        start = time.thread_time()
        stats = engine.stats()
        built = time.thread_time()
        data = pickle.dumps(stats, protocol=5)
        builds.append(built - start)
        pickles.append(time.thread_time() - built)
    return statistics.median(builds) * 1e6, statistics.median(pickles) * 1e6, len(data)


async def round_trips(busy_batch: int, asks: int) -> tuple[float, float, float]:
    """(idle ask ms, busy ask ms, busy step ms), medians, through a spawned engine process."""
    from sits.runtime.engine.core_client import MultiprocessEngineClient

    model = ModelConfig(load_format="dummy", config_name="tiny", device="cpu", dtype="float32", max_model_len=1024)
    config = EngineConfig(model=model, cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=busy_batch * 40),
                          scheduler=SchedulerConfig(max_num_seqs=busy_batch, max_num_batched_tokens=4096))
    client = MultiprocessEngineClient.spawn(config, log_level="warning")
    try:
        await client.start()
        idle = [_timed_ask(client) for _ in range(asks)]
        params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
        streams = [client.generate(list(range(3, 67)), params, f"busy-{i}") for i in range(busy_batch)]
        drains = [asyncio.create_task(_drain(stream)) for stream in streams]
        while client.stats().num_running < busy_batch:
            await asyncio.sleep(0.01)
        steps_before, started = client.stats().num_steps, time.perf_counter()
        busy = []
        for _ in range(asks):
            busy.append(_timed_ask(client))
            await asyncio.sleep(0.005)
        step_ms = (time.perf_counter() - started) * 1e3 / max(client.stats().num_steps - steps_before, 1)
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
    finally:
        await client.shutdown()
    return statistics.median(idle), statistics.median(busy), step_ms


def _timed_ask(client) -> float:
    start = time.perf_counter()
    client.stats()
    return (time.perf_counter() - start) * 1e3


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trip", action="store_true", help="also time asks through an engine process")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--context", type=int, default=2048, help="tokens per sequence while measured")
    parser.add_argument("--tenants", type=int, default=1, help="requests spread round-robin over this many tenants")
    parser.add_argument("--repeats", type=int, default=50, help="stats() builds timed per batch")
    parser.add_argument("--busy-batch", type=int, default=32, help="sequences decoding while --round-trip asks")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loaded = random_loaded_model(preset_config("tiny"), TorchAttentionBackend(), "cpu", torch.float32, seed=0,
                                 max_positions=args.context + 128, name="tiny")
    print(f"stats() per build (thread CPU time): tiny Llama, context ~{args.context}, {args.tenants} tenant(s)")
    print("| batch | build µs | pickle µs | pickled bytes |")
    print("|---|---|---|---|")
    for batch in args.batches:
        build_us, pickle_us, size = build_costs(steady_engine(loaded, batch, args.context, args.tenants), args.repeats)
        print(f"| {batch} | {build_us:,.0f} | {pickle_us:,.0f} | {size:,} |")
    if args.round_trip:
        idle_ms, busy_ms, step_ms = asyncio.run(round_trips(args.busy_batch, asks=40))
        print(f"\nask through the engine process (wall, median of 40): idle {idle_ms:.2f} ms; decoding "
              f"{args.busy_batch} sequences {busy_ms:.2f} ms (a step takes {step_ms:.2f} ms there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
