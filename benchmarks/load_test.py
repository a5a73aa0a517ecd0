"""Bounded load against an OpenAI-compatible server: N streaming clients for T seconds.

Each client loops until the deadline: one streaming chat (or completions) request, read to the end.
A 429 or 503 must be a well-formed refusal (OpenAI's error JSON and a Retry-After header); the
client then waits that long (capped) and tries again, as the official client does. Every
`--disconnect-every`-th request of a client is dropped after its first event (a client that goes
away mid-stream). Reported: requests admitted / refused / failed, p50 / p95 / p99 of time to first
token and end-to-end latency of the admitted ones, output tokens per second, the server's RSS
before, at peak and after (when its pid is known), and whether the server freed every KV block
and admission slot once the load ended (from /metrics).

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --pid $(pgrep -n -f 'sits serve')
    python benchmarks/load_test.py --serve "--max-num-seqs 32" --clients 200 --duration 60   # starts sits serve

The clients are `load_client.py`, the figures `load_report.py`, the server process `server_process.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    # Import the `benchmarks` package from the repository root, then take the root off sys.path again:
    # its `operator/` and `kernels/` folders must not shadow the standard library's and others' modules.
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from benchmarks.load_client import LoadConfig, Outcome, client_loop, warm_up  # noqa: E402
from benchmarks.load_report import LoadReport, ServerSample, compare  # noqa: E402
from benchmarks.server_process import engine_leftovers, rss_mb, sits_serve  # noqa: E402


async def run_load(config: LoadConfig, pid: int | None = None, settle_s: float = 20.0) -> LoadReport:
    """Run the load; sample the server's RSS (with its pid) and check it released everything after."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.clients + 4, max_keepalive_connections=config.clients + 4)
    server = ServerSample(rss_before_mb=rss_mb(pid))
    server.rss_peak_mb = server.rss_before_mb
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    deadline = started + config.duration_s
    timeout = httpx.Timeout(config.request_timeout_s, connect=30)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, timeout=timeout, limits=limits) as http:
        clients = [asyncio.create_task(client_loop(http, config, i, deadline, outcomes))
                   for i in range(config.clients)]
        while not all(c.done() for c in clients):
            await asyncio.wait(clients, timeout=0.5)
            current = rss_mb(pid)
            if current is not None and server.rss_peak_mb is not None:
                server.rss_peak_mb = max(server.rss_peak_mb, current)
        await asyncio.gather(*clients)
    wall = time.perf_counter() - started
    settle_deadline = time.monotonic() + settle_s
    while True:  # aborted streams end on the engine's next step: give it a moment
        server.leftover = await asyncio.to_thread(engine_leftovers, config.url)
        server.drained = not any(server.leftover.values())
        if server.drained or time.monotonic() > settle_deadline:
            break
        await asyncio.sleep(0.2)
    if server.drained:
        server.leftover = {}
    server.rss_after_mb = rss_mb(pid)
    return LoadReport(config=config, outcomes=outcomes, wall_s=wall, server=server)


UNBOUNDED = ["--max-waiting-requests", "1000000"]  # the peer: the same server with no bound on its queue


def run_against(config: LoadConfig, serve_args: list[str] | None, pid: int | None) -> LoadReport:
    """One load run: against config.url, or against a `sits serve SERVE_ARGS` started (and stopped) for it."""
    with contextlib.ExitStack() as stack:
        if serve_args is not None:
            log_path = os.path.join(tempfile.gettempdir(), f"sits-load-{os.getpid()}-{time.monotonic_ns()}.log")
            config.url, pid = stack.enter_context(sits_serve(serve_args, log_path))
            print(f"sits serve {shlex.join(serve_args)} at {config.url} (log {log_path})", flush=True)
        warm_up(config.url, config)
        return asyncio.run(run_load(config, pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--serve", metavar="ARGS", help="start `sits serve ARGS` for the run (quoted string)")
    parser.add_argument("--peer", action="store_true",
                        help="with --serve: run again against the same server with an unbounded queue, and compare")
    parser.add_argument("--pid", type=int, default=None, help="the server's pid, for its RSS (with --url)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--model", default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--disconnect-every", type=int, default=10,
                        help="each client drops every Nth stream after its first event (0: never)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)
    if args.peer and args.serve is None:
        parser.error("--peer needs --serve")

    def config() -> LoadConfig:
        return LoadConfig(url=args.url or "", clients=args.clients, duration_s=args.duration,
                          max_tokens=args.max_tokens, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                          disconnect_every=args.disconnect_every)

    serve_args = shlex.split(args.serve) if args.serve is not None else None
    report = run_against(config(), serve_args, args.pid)
    print(report.format(), flush=True)
    if args.json:
        print(json.dumps(report.figures()))
    failed = bool(report.failures or report.incomplete or report.server.drained is False)
    if args.peer and serve_args is not None:
        peer = run_against(config(), [*serve_args, *UNBOUNDED], None)
        print("peer, unbounded queue:\n" + peer.format())
        if args.json:
            print(json.dumps(peer.figures()))
        print(compare(report, peer))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
