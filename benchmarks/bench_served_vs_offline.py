"""Served against offline: what the HTTP path costs an engine that is fast, in the same run.

A small random model (`--config`, default `tiny`: the engine's step is short, so the server's own
work shows) is measured two ways, one after the other, for each B in --streams:
  - offline: `sits bench --config C --batch B` (B prompts at once), with the CPU time the engine spent per
    output token in its timed run (`cpu_s` in its JSON);
  - served: `sits bench serve` against `sits serve --load-format dummy --config C` (started here, once healthy)
    with B streams (`--max-concurrency B`, B prompts: the same work as the offline batch), with the CPU time
    the API process and the engine process spent per output token (from /proc: these hold on a loaded
    machine, where the throughputs are noisy), the API process's CPU per chunk the clients received (a
    chunk carries several tokens when the API process falls behind), and the client's CPU per output token
    (its run less a one-request run of it, which holds its start-up): on a shared CPU every served token
    costs the engine's, the API process's and the client's CPU time, the offline one the engine's only.
Every request has exactly --input-len prompt tokens and --output-len output tokens (EOS ignored).
The table prints output tok/s served, offline, and their ratio (the issue's target: >= 0.85 on CPU), and
the engine's CPU per token served / offline (what the process boundary costs the engine).

`--repeats N` runs N pairs per stream count, offline and served alternately first, and prints medians
with each pair's ratios: on a shared machine the load drifts between two runs a minute apart.

The client runs in a session of its own (`setsid`). Where the kernel shares CPU time between sessions
first (autogroup, on by default on desktop and VM kernels; this machine has it), a client in the
script's session would be paid for out of the server's share, as if the server had to run its own
clients, while the offline engine has that share to itself. In its own session the client competes for
the cores as any other process does; the system under test (the server, or the offline engine) gets one
session's share on both sides. `--client-in-server-session` measures the old way.

    python benchmarks/bench_served_vs_offline.py [--config tiny] [--streams 32 128] [--input-len 128]
        [--output-len 128] [--repeats 1] [--client-in-server-session] [--json FILE]

On a CPU the client shares the cores with the server: note the machine's load with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path

THREADS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def sits(*args: str, threads: int, own_session: bool = False) -> None:
    """Run `sits ARGS` in a child process with `threads` torch threads (a launched server inherits them);
    `own_session`: in a session of its own (`setsid`), so where the kernel groups CPU time by session
    (autogroup) it competes as another user's process would, not out of the server's share."""
    env = {**os.environ, **{name: str(threads) for name in THREADS_ENV}}
    result = subprocess.run([sys.executable, "-m", "sits.runtime.cli", *args], capture_output=True,
                            text=True, env=env, start_new_session=own_session)
    if result.returncode != 0:
        raise SystemExit(f"sits {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")


def offline_tok_s(config: str, batch: int, input_len: int, output_len: int, workdir: Path, threads: int) -> dict:
    out = workdir / f"offline-{batch}.json"
    sits("bench", "--config", config, "--batch", str(batch), "--input-len", str(input_len), "--output-len",
         str(output_len), "--peer", "none", "--warmup-output-len", "4", "--max-num-seqs", str(batch),
         "--log-level", "warning", "--json", str(out), threads=threads)
    result = json.loads(out.read_text())["results"][0]
    return {"output_tok_s": result["output_tok_s"], "itl_p50_ms": result["itl_p50_s"] * 1000,
            "itl_p99_ms": result["itl_p99_s"] * 1000,
            "engine_cpu_ms_per_token": 1e3 * result["cpu_s"] / (batch * output_len)}


def served_tok_s(config: str, streams: int, input_len: int, output_len: int, vocab: int, workdir: Path,
                 threads: int, client_session: bool = True) -> dict:
    """`sits bench serve` against a `sits serve --load-format dummy` started here, and the CPU seconds its two
    processes spent on the run (from /proc, so the figures hold on a loaded machine too)."""
    out = workdir / f"served-{streams}.json"
    env = {**os.environ, **{name: str(threads) for name in THREADS_ENV}}
    port = free_port()
    serve = ["--load-format", "dummy", "--config", config, "--max-num-seqs", str(streams), "--max-waiting-requests",
             str(streams), "--max-model-len", str(input_len + output_len), "--log-level", "warning", "--port", str(port)]
    server = subprocess.Popen([sys.executable, "-m", "sits.runtime.cli", "serve", *serve], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}/health")
        processes = {"api": server.pid, "engine": engine_child(server.pid)}
        before = {name: cpu_seconds(pid) for name, pid in processes.items()}

        def client(prompts: int, tokens: int, json_out: Path) -> float:
            """CPU seconds of one `sits bench serve` run (its start-up included)."""
            begin = children_cpu_seconds()
            sits("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(prompts),
                 "--max-concurrency", str(prompts), "--random-input-len", str(input_len), "--random-output-len",
                 str(tokens), "--vocab-size", str(vocab), "--no-progress", "--json", str(json_out), threads=threads,
                 own_session=client_session)
            return children_cpu_seconds() - begin

        client_cpu = client(streams, output_len, out)
        cpu_ms = {name: 1e3 * (cpu_seconds(pid) - before[name]) / (streams * output_len)
                  for name, pid in processes.items()}
        # the client's start-up (imports, the model list, /metrics) and its run, less a one-request run's
        startup_cpu = client(1, 1, workdir / "served-startup.json")
        cpu_ms["client"] = 1e3 * (client_cpu - startup_cpu) / (streams * output_len)
    finally:
        server.terminate()
        server.wait(60)
    report = json.loads(out.read_text())
    result = report["results"]
    if result["failed"]:
        raise SystemExit(f"served run at {streams} streams: {result['failed_by_status']} failed requests")
    # Chunks the clients received: when the API process falls behind, a chunk carries several tokens and
    # its CPU per token drops, so its CPU per chunk is the figure that compares runs of one code.
    chunks = sum(len(request["chunk_times_s"]) for request in report["requests"])
    return {"output_tok_s": result["output_throughput"], "itl_p50_ms": result["itl_ms"]["median"],
            "itl_p99_ms": result["itl_ms"]["p99"], "ttft_p50_ms": result["ttft_ms"]["median"],
            "api_cpu_ms_per_token": cpu_ms["api"], "engine_cpu_ms_per_token": cpu_ms["engine"],
            "client_cpu_ms_per_token": cpu_ms["client"],
            "tokens_per_chunk": streams * output_len / chunks,
            "api_cpu_us_per_chunk": 1e3 * cpu_ms["api"] * streams * output_len / chunks}


def _medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's children that have ended (and been waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(server: subprocess.Popen, url: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"sits serve did not come up (exit code {server.poll()})") from None
            time.sleep(0.2)


def engine_child(pid: int) -> int:
    """The engine process the server at `pid` spawned (its child running multiprocessing's spawn_main)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            command = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in command and b"resource_tracker" not in command:
                return int(child)
    raise SystemExit(f"no engine process under the server {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    parser.add_argument("--repeats", type=int, default=1,
                        help="offline and served runs per stream count, alternately first; the table gives "
                             "medians and the medians of each pair's ratios (the load drifts between runs)")
    parser.add_argument("--client-in-server-session", action="store_true",
                        help="run the benchmark client in this script's session, with the server (before "
                             "2026-12-02 it ran there; see the module docstring)")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    from sits.runtime.models.presets import preset_config

    rows = _measure_rows(args, preset_config(args.config).vocab_size)
    load = os.getloadavg()
    _print_rows(args, rows, load)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "threads": args.threads, "input_len": args.input_len,
                                               "output_len": args.output_len, "load_average": load, "rows": rows},
                                              indent=1))
    return 0


def _measure_rows(args: argparse.Namespace, vocab: int) -> list[dict]:
    """Per stream count: --repeats pairs of offline and served runs (alternately first), with their medians."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="sits-served-vs-offline-") as workdir:
        for streams in args.streams:
            pairs = []
            offline = partial(offline_tok_s, args.config, streams, args.input_len, args.output_len, Path(workdir),
                              args.threads)
            served = partial(served_tok_s, args.config, streams, args.input_len, args.output_len, vocab, Path(workdir),
                             args.threads, client_session=not args.client_in_server_session)
            for repeat in range(args.repeats):
                if repeat % 2 == 0:  # alternate which side runs first: the load drifts between the two
                    off = offline()
                    srv = served()
                else:
                    srv = served()
                    off = offline()
                pairs.append({"offline": off, "served": srv, "ratio": srv["output_tok_s"] / off["output_tok_s"],
                              "engine_cpu_ratio": srv["engine_cpu_ms_per_token"] / off["engine_cpu_ms_per_token"]})
            rows.append({"streams": streams, "offline": _medians([pair["offline"] for pair in pairs]),
                         "served": _medians([pair["served"] for pair in pairs]),
                         "ratio": statistics.median(pair["ratio"] for pair in pairs),
                         "engine_cpu_ratio": statistics.median(pair["engine_cpu_ratio"] for pair in pairs),
                         "pairs": pairs})
    return rows


def _print_rows(args: argparse.Namespace, rows: list[dict], load: tuple[float, float, float]) -> None:
    """The table of medians, then each pair's ratios when there are several."""
    print(f"\nserved vs offline: random {args.config} weights, {args.input_len} in / {args.output_len} out, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch thread(s), load average {load[0]:.1f} at the end")
    print(f"{'streams':>8} {'offline tok/s':>14} {'served tok/s':>13} {'ratio':>7} {'ITL p50/p99 offline ms':>24} "
          f"{'ITL p50/p99 served ms':>23} {'CPU ms/token API / engine':>26} {'engine CPU offline':>19} "
          f"{'engine CPU ratio':>17} {'client CPU':>11} {'API us/chunk':>13} {'tokens/chunk':>13}")
    for row in rows:
        off, srv = row["offline"], row["served"]
        print(f"{row['streams']:>8} {off['output_tok_s']:>14.0f} {srv['output_tok_s']:>13.0f} {row['ratio']:>6.2f}x "
              f"{off['itl_p50_ms']:>11.1f} / {off['itl_p99_ms']:<10.1f} {srv['itl_p50_ms']:>10.1f} / "
              f"{srv['itl_p99_ms']:<10.1f} {srv['api_cpu_ms_per_token']:>12.3f} / {srv['engine_cpu_ms_per_token']:<11.3f} "
              f"{off['engine_cpu_ms_per_token']:>19.3f} {row['engine_cpu_ratio']:>16.2f}x "
              f"{srv['client_cpu_ms_per_token']:>11.3f} "
              f"{srv['api_cpu_us_per_chunk']:>13.1f} {srv['tokens_per_chunk']:>13.2f}")
    if args.repeats > 1:
        print(f"medians of {args.repeats} pairs (offline and served alternately first); each pair's ratio "
              f"(served / offline tok/s, engine CPU per token):")
        for row in rows:
            print(f"{row['streams']:>8} " + "  ".join(f"{pair['ratio']:.2f}x / {pair['engine_cpu_ratio']:.2f}x"
                                                       for pair in row["pairs"]))


if __name__ == "__main__":
    sys.exit(main())
