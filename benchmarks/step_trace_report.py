"""Summarise a served engine's step trace (`SITS_ENGINE_STEP_TRACE`): where the steps' time went.

    python benchmarks/step_trace_report.py DIR_OR_FILE [--json out.json]

Each step's time is the gap between its line and the one before (`sits.runtime.engine.step_trace`: with async
scheduling, the device time of the step completed in that call). Printed: steps and their total time by class
(decode only, prefill only, decodes beside <= N prompt tokens), each class's p50 / p90 / max in ms, the decode
sequences and prompt tokens of an average step, and the share of time spent in steps of 50 ms or more.
`benchmarks/gpu_serving_run.sh` writes one trace per served step and prints this beside its summary line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

LONG_STEP_MS = 50.0


def summarise(lines: list[dict]) -> dict:
    """Per class: steps, total ms, p50 / p90 / max ms; overall: steps, mean decodes and prompt tokens a step,
    share of time in steps of LONG_STEP_MS or more. The first line has no step before it and is left out."""
    from sits.runtime.commands.bench_serve_metrics import percentile
    from sits.runtime.engine.step_trace import step_class

    steps = [(line, 1000.0 * (line["t_s"] - before["t_s"])) for before, line in zip(lines, lines[1:], strict=False)]
    by_class: dict[str, list[float]] = defaultdict(list)
    for line, ms in steps:
        by_class[step_class(line["decodes"], line["prompt_tokens"])].append(ms)
    total = sum(ms for _, ms in steps) or 1e-9
    return {
        "steps": len(steps),
        "mean_decodes": sum(line["decodes"] for line, _ in steps) / max(len(steps), 1),
        "mean_prompt_tokens": sum(line["prompt_tokens"] for line, _ in steps) / max(len(steps), 1),
        "long_step_time_share": sum(ms for _, ms in steps if ms >= LONG_STEP_MS) / total,
        "classes": {name: {"steps": len(v), "time_share": sum(v) / total, "p50_ms": percentile(v, 50),
                           "p90_ms": percentile(v, 90), "max_ms": max(v)}
                    for name, v in sorted(by_class.items(), key=lambda kv: -sum(kv[1]))},
    }


def format_summary(name: str, summary: dict) -> str:
    out = [f"{name}: {summary['steps']} steps, {summary['mean_decodes']:.0f} decodes and "
           f"{summary['mean_prompt_tokens']:.0f} prompt tokens a step on average, "
           f"{summary['long_step_time_share']:.1%} of the time in steps of {LONG_STEP_MS:g} ms or more",
           "| step class | steps | share of time | ms p50 | ms p90 | ms max |", "|---|---|---|---|---|---|"]
    for cls, c in summary["classes"].items():
        out.append(f"| {cls} | {c['steps']} | {c['time_share']:.1%} | {c['p50_ms']:.1f} | {c['p90_ms']:.1f} | "
                   f"{c['max_ms']:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from sits.runtime.engine.step_trace import read_step_trace

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a trace file, or the folder SITS_ENGINE_STEP_TRACE named")
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args(argv)
    files = sorted(args.path.glob("engine-*-steps.jsonl")) if args.path.is_dir() else [args.path]
    if not files or not all(f.is_file() for f in files):
        parser.error(f"no step trace at {args.path}")
    summaries = {}
    for file in files:
        summaries[file.name] = summarise(read_step_trace(file))
        print(format_summary(file.name, summaries[file.name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
