"""Where a decode's inter-token gap goes: the offline engine's steps, one by one.

    python benchmarks/bench_step_trace.py --config llama-3-8b --batch 256 --input-len 1024 --output-len 512 \
        --prompts 512 [--max-prefill-tokens-with-decodes 2048] [--json trace.json]

Runs `--prompts` random prompts through the engine with at most `--batch` in flight (a closed loop, as
`sits bench serve --max-concurrency` drives a server: a finished request is replaced at once), after a
warm-up batch. Every step records its composition (decode sequences, prompt tokens, new sequences)
and its wall time (ms, the gap between the step's return and the previous one: with async scheduling
that is the device time of the step completed in that call). Prints the step-time distribution per
composition class, the slowest steps with what they held, the per-token gaps (ITL p50 / p90 / p99)
and which class of step the p99 gaps fall in. The figures say whether a tail comes from prefill
chunks beside decodes (the latency budget's case), from steps without any prefill (something else:
a host stall such as a full garbage collection, see `--no-gc-freeze`; a kernel's first run) or from
the first wave's ramp.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1: import `benchmarks` from the root
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)


@dataclass
class StepRecord:
    """One engine.step() call: what it scheduled and how long the call took (ms)."""

    index: int
    decodes: int
    prompt_tokens: int
    new_sequences: int
    ms: float
    phases: dict[str, float] | None = None  # ms per engine phase of the call (`--host-phases`)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_closed_loop(engine, compositions: list, prompts, output_len: int, concurrency: int, clock=None):
    """Closed loop over the prompts; returns (step records, per-token gaps in ms, seconds, tokens).
    `compositions`: the list the engine's step_observer appends each step's StepComposition to;
    `clock`: an `engine_phases.PhaseClock` instrumenting the engine, read once per call."""
    from sits.runtime.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    del compositions[:]  # the warm-up's
    times: dict[str, list[float]] = defaultdict(list)
    steps: list[StepRecord] = []
    queue = list(enumerate(prompts))[::-1]
    start = last = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < concurrency:
            index, prompt = queue.pop()
            engine.add_request(f"trace-{index}", prompt, params)
        before = len(compositions)
        outputs = engine.step()
        now = time.perf_counter()
        phases = {k: v * 1e3 for k, v in clock.take().items()} if clock is not None else None
        if len(compositions) > before:  # the composition of the step completed in this call
            done = compositions[-2] if engine.async_scheduling and len(compositions) >= 2 else compositions[-1]
            steps.append(StepRecord(len(steps), done.decodes, done.prompt_tokens, done.new_sequences,
                                    ms=(now - last) * 1e3, phases=phases))
        last = now
        for output in outputs:
            times[output.request_id].extend([now] * len(output.outputs[0].token_ids_delta))
    gaps = [(b - a) * 1e3 for stamps in times.values() for a, b in zip(stamps, stamps[1:], strict=False)]
    return steps, gaps, time.perf_counter() - start, sum(len(t) for t in times.values())


def report(steps: list[StepRecord], gaps: list[float], seconds: float, tokens: int) -> dict:
    from sits.runtime.engine.step_trace import step_class

    by_class: dict[str, list[float]] = defaultdict(list)
    for record in steps:
        by_class[step_class(record.decodes, record.prompt_tokens)].append(record.ms)
    print(f"\n{len(steps)} steps, {tokens} output tokens in {seconds:.1f} s = {tokens / seconds:.0f} tok/s")
    print(f"ITL ms: p50 {_percentile(gaps, 50):.2f}  p90 {_percentile(gaps, 90):.2f}  p99 {_percentile(gaps, 99):.2f}"
          f"  max {max(gaps, default=0):.1f}  (p99/p50 {_percentile(gaps, 99) / _percentile(gaps, 50):.2f})")
    print("\n| step class | steps | ms p50 | ms p90 | ms max | share of time |")
    print("|---|---|---|---|---|---|")
    total = sum(r.ms for r in steps) or 1.0
    for name, values in sorted(by_class.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(values)} | {_percentile(values, 50):.1f} | {_percentile(values, 90):.1f} | "
              f"{max(values):.1f} | {sum(values) / total:.1%} |")
    _print_phases(steps)
    print("\nslowest steps: index, decodes, prompt tokens, new sequences, ms[, the call's phases in ms]")
    for record in sorted(steps, key=lambda r: -r.ms)[:25]:
        phases = "  " + " ".join(f"{k} {v:.1f}" for k, v in record.phases.items()) if record.phases else ""
        print(f"  {record.index:6d} {record.decodes:5d} {record.prompt_tokens:6d} {record.new_sequences:4d} "
              f"{record.ms:8.1f}{phases}")
    return {"steps": [asdict(r) for r in steps], "itl_ms": {q: _percentile(gaps, q) for q in (50, 90, 99)},
            "output_tok_s": tokens / seconds}


def _print_phases(steps: list[StepRecord]) -> None:
    """Per step class, the median ms of each engine phase in the calls (and "gap": the rest of the call's
    interval: the loop's own work between calls)."""
    from benchmarks.engine_phases import PHASES
    from sits.runtime.engine.step_trace import step_class

    timed = [r for r in steps if r.phases is not None]
    if not timed:
        return
    by_class: dict[str, list[StepRecord]] = defaultdict(list)
    for record in timed:
        by_class[step_class(record.decodes, record.prompt_tokens)].append(record)
    names = [p for p in PHASES if p != "other"]
    print("\n| step class (median ms) | " + " | ".join(names) + " | gap |")
    print("|---|" + "---|" * (len(names) + 1))
    for name, records in sorted(by_class.items(), key=lambda kv: -len(kv[1])):
        cells = [_percentile([r.phases.get(p, 0.0) for r in records], 50) for p in names]
        cells.append(_percentile([r.ms - sum(r.phases.values()) for r in records], 50))
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


def main(argv=None) -> int:
    from sits.runtime.commands import bench
    from sits.runtime.commands.engine_args import configure_logging
    from sits.runtime.engine.step_trace import StepComposition
    from sits.runtime.gc_heap import frozen_startup_heap

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_bench_arguments(parser)
    parser.add_argument("--prompts", type=int, default=None, help="prompts in all (default: --batch)")
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                        help="freeze the start-up heap before the run, as the engine process does (gc_heap.py)")
    parser.add_argument("--host-phases", action="store_true",
                        help="time the engine's phases in every call (benchmarks/engine_phases.py)")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    config = bench.build_config(args)
    loaded = bench.load(args, config)
    compositions: list[StepComposition] = []
    engine = bench.new_engine(args, loaded, config,
                              step_observer=lambda output: compositions.append(StepComposition.of(output)))
    vocab = loaded.config.vocab_size
    if args.warmup_output_len:
        warmup = bench.random_prompts(args.batch, args.input_len, vocab, config.model.seed + 2)
        bench.run_engine(engine, warmup, min(args.warmup_output_len, args.output_len), "warmup")
    prompts = bench.random_prompts(args.prompts or args.batch, args.input_len, vocab, config.model.seed + 1)
    clock = None
    if args.host_phases:
        from benchmarks.engine_phases import PhaseClock, instrument

        clock = PhaseClock()
        instrument(engine, clock)
    with frozen_startup_heap("trace") if args.gc_freeze else nullcontext():
        steps, gaps, seconds, tokens = run_closed_loop(engine, compositions, prompts, args.output_len, args.batch,
                                                       clock)
    result = report(steps, gaps, seconds, tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
