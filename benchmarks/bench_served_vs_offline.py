"""Served against offline: what the HTTP path costs an engine that is fast, in the same run.

A small random model (`--config`, default `tiny`: the engine's step is short, so the server's own
work shows) is measured three or more ways, one after another, each with the machine to itself:
  - offline: `sits bench --config C --batch B` (B prompts at once, B = the largest stream count),
    and once more at every other stream count;
  - served: `sits bench serve --launch "--load-format dummy --config C"` with B streams
    (`--max-concurrency B`, B prompts: the same work as the offline batch), for each B in --streams.
Every request has exactly --input-len prompt tokens and --output-len output tokens (EOS ignored).
The table prints output tok/s served, offline, and their ratio (the issue's target: >= 0.85 on CPU).

    python benchmarks/bench_served_vs_offline.py [--config tiny] [--streams 32 128] [--input-len 128]
        [--output-len 128] [--json FILE]

On a CPU the client shares the cores with the server: note the machine's load with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

THREADS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def sits(*args: str, threads: int) -> None:
    """Run `sits ARGS` in a child process with `threads` torch threads (a launched server inherits them)."""
    env = {**os.environ, **{name: str(threads) for name in THREADS_ENV}}
    result = subprocess.run([sys.executable, "-m", "sits.runtime.cli", *args], capture_output=True,
                            text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"sits {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")


def offline_tok_s(config: str, batch: int, input_len: int, output_len: int, workdir: Path, threads: int) -> dict:
    out = workdir / f"offline-{batch}.json"
    sits("bench", "--config", config, "--batch", str(batch), "--input-len", str(input_len), "--output-len",
         str(output_len), "--peer", "none", "--warmup-output-len", "4", "--max-num-seqs", str(batch),
         "--log-level", "warning", "--json", str(out), threads=threads)
    result = json.loads(out.read_text())["results"][0]
    return {"output_tok_s": result["output_tok_s"], "itl_p50_ms": result["itl_p50_s"] * 1000,
            "itl_p99_ms": result["itl_p99_s"] * 1000}


def served_tok_s(config: str, streams: int, input_len: int, output_len: int, vocab: int, workdir: Path,
                 threads: int) -> dict:
    out = workdir / f"served-{streams}.json"
    serve = (f"--load-format dummy --config {config} --max-num-seqs {streams} --max-waiting-requests {streams} "
             f"--max-model-len {input_len + output_len} --log-level warning")
    sits("bench", "serve", "--launch", serve, "--num-prompts", str(streams), "--max-concurrency", str(streams),
         "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--vocab-size", str(vocab),
         "--no-progress", "--json", str(out), threads=threads)
    result = json.loads(out.read_text())["results"]
    if result["failed"]:
        raise SystemExit(f"served run at {streams} streams: {result['failed_by_status']} failed requests")
    return {"output_tok_s": result["output_throughput"], "itl_p50_ms": result["itl_ms"]["median"],
            "itl_p99_ms": result["itl_ms"]["p99"], "ttft_p50_ms": result["ttft_ms"]["median"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", help="the random model's shape (sits.runtime.models.presets)")
    parser.add_argument("--streams", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch (OpenMP) threads of the engine, offline and served alike (default 1: on a "
                             "small loaded CPU two spinning threads cost more than they give, and the client needs "
                             "a core)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    from sits.runtime.models.presets import preset_config

    vocab = preset_config(args.config).vocab_size
    rows = []
    with tempfile.TemporaryDirectory(prefix="sits-served-vs-offline-") as workdir:
        for streams in args.streams:
            offline = offline_tok_s(args.config, streams, args.input_len, args.output_len, Path(workdir), args.threads)
            served = served_tok_s(args.config, streams, args.input_len, args.output_len, vocab, Path(workdir),
                                  args.threads)
            rows.append({"streams": streams, "offline": offline, "served": served,
                         "ratio": served["output_tok_s"] / offline["output_tok_s"]})
    load = os.getloadavg()
    print(f"\nserved vs offline: random {args.config} weights, {args.input_len} in / {args.output_len} out, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch thread(s), load average {load[0]:.1f} at the end")
    print(f"{'streams':>8} {'offline tok/s':>14} {'served tok/s':>13} {'ratio':>7} {'ITL p50/p99 offline ms':>24} "
          f"{'ITL p50/p99 served ms':>23}")
    for row in rows:
        off, srv = row["offline"], row["served"]
        print(f"{row['streams']:>8} {off['output_tok_s']:>14.0f} {srv['output_tok_s']:>13.0f} {row['ratio']:>6.2f}x "
              f"{off['itl_p50_ms']:>11.1f} / {off['itl_p99_ms']:<10.1f} {srv['itl_p50_ms']:>10.1f} / "
              f"{srv['itl_p99_ms']:<10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "threads": args.threads, "input_len": args.input_len,
                                               "output_len": args.output_len, "load_average": load, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
