"""The engine's host work per decode step, phase by phase, on a CPU.

A GPU decode step of an 8B model is ~6-8 ms of device work; whatever the engine does on the host
between two steps (schedule, build the batch, wait for and read the sampled tokens, update the
sequences, detokenize and build the outputs) is time the GPU idles unless it overlaps the next step.
This benchmark measures that host work where it can be measured without a GPU: the real engine
(`LLMEngine`) over the real `tiny` Llama (2 layers, hidden 64, torch attention back end, float32),
whose forward is cheap and is timed apart and subtracted. Every phase is timed with perf_counter
around the engine's own calls (wrapped on the instances, not replaced):

    schedule   Scheduler.schedule
    inputs     the runner building the step's flat batch (block tables, positions, slots, copy)
    forward    the model forward (model compute: subtracted)
    logits     the LM head on the sampled rows (model compute: subtracted)
    sample     the Sampler (token choice, ids back to Python)
    update     Scheduler.update_from_output (+ finishing sequences)
    outputs    OutputProcessor.process (detokenization, stop strings, RequestOutput snapshots)
    other      the rest of LLMEngine.step
    host       step - forward - logits: the figure a GPU would idle for, were nothing overlapped

The batch: `batch` requests whose prompts share all but their last block (so one prefill computes
the shared context and the others hit the prefix cache: no slow CPU prefill of batch x context
tokens), each generating `warmup + steps` tokens greedily with EOS ignored, through
`TokenIdTokenizer` (what `sits bench --config` detokenizes with). Only the `steps` decode-only steps
after the warm-up are timed, with every context at ~`context` tokens (block tables of context / 16
blocks), with the start-up heap frozen as the engine process and `sits bench` run (`runtime/gc_heap.py`:
otherwise full collections scanning torch's objects land in whichever phase allocates). Figures are
medians over those steps (the machine's other work shows up as outliers).

    python benchmarks/bench_engine_host_overhead.py [--batches 1 32 256] [--context 2048] [--steps 24]

With `--async-scheduling both` (the default when the engine has the switch) each batch runs twice in
the same process, the overlap off then on, and the table puts them side by side; on a CPU the
forward runs synchronously on the calling thread, so the overlap cannot hide anything here: the
figure to compare is the host work itself, which on a GPU runs while the device computes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.gc_heap import frozen_startup_heap
from sits.runtime.models.presets import preset_config
from sits.runtime.models.random_model import random_loaded_model

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    # Import the `benchmarks` package from the repository root, then take the root off sys.path again:
    # its `operator/` and `kernels/` folders must not shadow the standard library's and others' modules.
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from benchmarks.engine_phases import MODEL_PHASES, PHASES, PhaseClock, instrument  # noqa: E402
from benchmarks.run_report import cpu_name, print_report  # noqa: E402

BLOCK_SIZE = 16


@dataclasses.dataclass
class RunFigures:
    batch: int
    mode: str
    steps: int
    phase_us: dict[str, float]  # median µs per step
    step_us: float
    host_us: float
    context: int


def build_engine(loaded, batch: int, context: int, total_new: int, async_mode: bool | None) -> LLMEngine:
    blocks_per_seq = -(-(context + total_new) // BLOCK_SIZE)
    config = EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32", max_model_len=context + total_new + BLOCK_SIZE),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks_per_seq + batch * (4 + total_new // BLOCK_SIZE)),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, context + BLOCK_SIZE)),
    )
    if async_mode is not None:
        config.async_scheduling = async_mode
    return LLMEngine.from_loaded(loaded, config)


def run_batch(loaded, batch: int, context: int, warmup: int, steps: int, async_mode: bool | None,
              clock: Callable[[], float]) -> RunFigures:
    total_new = warmup + steps
    prompt_len = context - warmup
    shared = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE  # every prompt differs in its last block only
    generator = torch.Generator().manual_seed(batch)
    vocab = loaded.config.vocab_size
    common = torch.randint(3, vocab, (shared,), generator=generator).tolist()
    engine = build_engine(loaded, batch, context, total_new, async_mode)
    params = SamplingParams(temperature=0.0, max_tokens=total_new, ignore_eos=True)
    produced = 0
    for index in range(batch):
        tail = torch.randint(3, vocab, (prompt_len - shared,), generator=generator).tolist()
        engine.add_request(f"r{index}", common + tail, params)
        while index == 0 and not produced:  # its prefill caches the shared blocks, which the others hit
            produced += _count_tokens(engine.step())
    phases_clock = PhaseClock(clock)
    instrument(engine, phases_clock)
    timed: list[tuple[float, dict[str, float]]] = []
    with frozen_startup_heap("bench_engine_host_overhead"):  # as the engine process and `sits bench` run
        produced = _time_steps(engine, phases_clock, clock, timed, (batch, warmup, steps), produced)
    if len(timed) < steps // 2:
        raise RuntimeError(f"only {len(timed)} steady decode steps were measured at batch {batch}")
    if produced != batch * total_new:
        raise RuntimeError(f"the engine produced {produced} tokens, expected {batch * total_new}")
    medians = {}
    for phase in PHASES[:-1]:
        medians[phase] = statistics.median(p.get(phase, 0.0) for _, p in timed) * 1e6
    step_us = statistics.median(e for e, _ in timed) * 1e6
    host = statistics.median(e - sum(p.get(m, 0.0) for m in MODEL_PHASES) for e, p in timed) * 1e6
    medians["other"] = statistics.median(e - sum(p.values()) for e, p in timed) * 1e6
    mode = "sync" if async_mode is None else ("async" if async_mode else "sync")
    return RunFigures(batch, mode, len(timed), medians, step_us, host, context)


def _time_steps(engine: LLMEngine, phases_clock: PhaseClock, clock: Callable[[], float],
                timed: list[tuple[float, dict[str, float]]], shape: tuple[int, int, int], produced: int) -> int:
    """Step the engine to the end, appending (seconds, phases) of each steady decode step to `timed`;
    returns the tokens produced in all (`produced` before, plus these steps')."""
    batch, warmup, steps = shape
    while engine.has_unfinished_requests():
        start = clock()
        outputs = engine.step()
        elapsed = clock() - start
        phases = phases_clock.take()
        produced_before = produced
        produced += _count_tokens(outputs)
        # Time only steady decode steps: every sequence past its warm-up tokens, none finishing.
        decoding = produced_before >= batch * warmup and produced - produced_before == batch
        if decoding and len(timed) < steps and not any(o.finished for o in outputs):
            timed.append((elapsed, phases))
    return produced


def _count_tokens(outputs) -> int:
    return sum(len(c.token_ids_delta) for o in outputs for c in o.outputs)


def print_table(results: list[RunFigures]) -> None:
    modes = sorted({r.mode for r in results}, reverse=True)
    header = ["phase (µs / step, median)"] + [f"B{r.batch} {r.mode}" if len(modes) > 1 else f"B{r.batch}"
                                              for r in results]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for phase in PHASES:
        tag = " (model)" if phase in MODEL_PHASES else ""
        print("| " + " | ".join([phase + tag] + [f"{r.phase_us[phase]:,.0f}" for r in results]) + " |")
    print("| " + " | ".join(["**host** (step - model)"] + [f"**{r.host_us:,.0f}**" for r in results]) + " |")
    print("| " + " | ".join(["host µs per sequence"] + [f"{r.host_us / r.batch:,.1f}" for r in results]) + " |")
    print("| " + " | ".join(["step"] + [f"{r.step_us:,.0f}" for r in results]) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--context", type=int, default=2048, help="tokens per sequence while timed")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch")
    parser.add_argument("--warmup", type=int, default=4, help="decode steps before timing")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this thread's CPU time (what other processes on a shared machine do not "
                             "inflate); wall: perf_counter")
    parser.add_argument("--async-scheduling", choices=("both", "on", "off"), default="both",
                        help="the engine's overlap switch (ignored when the engine has none)")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    has_switch = "async_scheduling" in {f.name for f in dataclasses.fields(EngineConfig)}
    modes: list[bool | None] = [None]
    if has_switch:
        modes = {"both": [False, True], "on": [True], "off": [False]}[args.async_scheduling]
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    shape = preset_config("tiny")
    loaded = random_loaded_model(shape, TorchAttentionBackend(), "cpu", torch.float32, seed=0,
                                 max_positions=args.context + args.warmup + args.steps + 2 * BLOCK_SIZE, name="tiny")
    results = []
    for batch in args.batches:
        for mode in modes:
            figures = run_batch(loaded, batch, args.context, args.warmup, args.steps, mode, clock)
            results.append(figures)
            print(f"batch {batch} {figures.mode}: host {figures.host_us:,.0f} µs / step "
                  f"({figures.steps} steps timed)", file=sys.stderr)
    clock_name = "thread CPU" if args.clock == "cpu" else "wall"
    print_report(f"engine host work per decode step ({clock_name} time): tiny Llama (torch back end, fp32), "
                 f"context ~{args.context}, {args.threads} torch thread(s), {cpu_name()}, torch {torch.__version__}",
                 print_table, results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
