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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = ["What is the capital of France?", "Why is the sky blue?", "Write a haiku about autumn leaves.",
           "Explain photosynthesis to a child.", "How do airplanes fly?", "Name three planets and a fact each.",
           "Tell me a short joke.", "How do bees make honey?", "What is gravity?", "Describe a cat in one sentence."]
REFUSALS = (429, 503)


@dataclass
class LoadConfig:
    """What to send. `max_retry_wait_s` caps how long a refused client honours Retry-After."""

    url: str
    clients: int = 40
    duration_s: float = 10.0
    max_tokens: int = 32
    endpoint: str = "chat"  # chat | completions
    model: str | None = None
    api_key: str | None = None
    disconnect_every: int = 0  # 0: never drop a stream
    max_retry_wait_s: float = 2.0
    request_timeout_s: float = 300.0
    seed: int = 0


@dataclass
class Outcome:
    """One request: its status and, when admitted, its timings (seconds) and whether it ended cleanly."""

    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    complete: bool = False  # a finish_reason and then [DONE]: nothing half-written
    disconnected: bool = False  # this client dropped the stream on purpose
    refusal_ok: bool | None = None  # for 429 / 503: OpenAI error JSON + Retry-After
    error: str | None = None


@dataclass
class ServerSample:
    rss_before_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_after_mb: float | None = None
    drained: bool | None = None  # after the load: no sequence running or waiting, no KV block held
    leftover: dict[str, float] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class LoadReport:
    config: LoadConfig
    outcomes: list[Outcome]
    wall_s: float
    server: ServerSample

    @property
    def admitted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    @property
    def refused(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in REFUSALS]

    @property
    def failures(self) -> list[Outcome]:
        """Anything a healthy server must never answer: 5xx other than a well-formed 503, transport errors."""
        return [o for o in self.outcomes if (o.status >= 500 and o.status != 503) or o.status == 0
                or (o.status == 503 and not o.refusal_ok)]

    @property
    def incomplete(self) -> list[Outcome]:
        """Admitted streams that ended without a finish_reason and [DONE], though the client stayed."""
        return [o for o in self.admitted if not o.complete and not o.disconnected]

    def figures(self) -> dict[str, object]:
        done = [o for o in self.admitted if o.complete]
        ttft = [o.ttft_s for o in done if o.ttft_s is not None]
        e2e = [o.e2e_s for o in done if o.e2e_s is not None]
        statuses: dict[str, int] = {}
        for o in self.outcomes:
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        return {
            "clients": self.config.clients, "duration_s": round(self.wall_s, 1), "requests": len(self.outcomes),
            "admitted": len(self.admitted), "completed": len(done),
            "disconnected": sum(o.disconnected for o in self.admitted),
            "refused": len(self.refused), "refusals_well_formed": all(o.refusal_ok for o in self.refused),
            "failures": len(self.failures), "incomplete": len(self.incomplete), "statuses": statuses,
            **{f"ttft_p{q}_s": _round(percentile(ttft, q)) for q in (50, 95, 99)},
            **{f"e2e_p{q}_s": _round(percentile(e2e, q)) for q in (50, 95, 99)},
            "output_tokens_per_s": round(sum(o.tokens for o in self.admitted) / max(self.wall_s, 1e-9), 1),
            **asdict(self.server),
        }

    def format(self) -> str:
        f = self.figures()
        lines = [
            f"{f['clients']} streaming clients for {f['duration_s']} s against {self.config.url} ({self.config.endpoint}, "
            f"max_tokens {self.config.max_tokens})",
            f"requests {f['requests']}: admitted {f['admitted']} (completed {f['completed']}, dropped by the client "
            f"{f['disconnected']}), refused {f['refused']} (well-formed: {f['refusals_well_formed']}), "
            f"failures {f['failures']}, half-written {f['incomplete']}; statuses {f['statuses']}",
            f"TTFT p50 / p95 / p99: {f['ttft_p50_s']} / {f['ttft_p95_s']} / {f['ttft_p99_s']} s; "
            f"end-to-end p50 / p95 / p99: {f['e2e_p50_s']} / {f['e2e_p95_s']} / {f['e2e_p99_s']} s; "
            f"{f['output_tokens_per_s']} output tok/s",
        ]
        if f["rss_before_mb"] is not None:
            lines.append(f"server RSS: before {f['rss_before_mb']} MB, peak {f['rss_peak_mb']} MB, "
                         f"after {f['rss_after_mb']} MB")
        if f["drained"] is not None:
            lines.append(f"after the load: every sequence ended and every KV block freed: {f['drained']} "
                         f"{f['leftover'] or ''}".rstrip())
        return "\n".join(lines)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def well_formed_refusal(response: httpx.Response, body: bytes) -> bool:
    """OpenAI's error JSON ({"error": {message, type, param, code}}) and an integer Retry-After >= 1."""
    try:
        error = json.loads(body)["error"]
        shaped = set(error) == {"message", "type", "param", "code"} and bool(error["message"])
    except (ValueError, KeyError, TypeError):
        return False
    retry_after = response.headers.get("retry-after", "")
    return shaped and retry_after.isdigit() and int(retry_after) >= 1


def request_body(config: LoadConfig, rng: random.Random) -> tuple[str, dict]:
    prompt = rng.choice(PROMPTS)
    common = {"max_tokens": config.max_tokens, "stream": True, "temperature": 0.8, "ignore_eos": True,
              **({"model": config.model} if config.model else {})}
    if config.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


async def one_request(http: httpx.AsyncClient, config: LoadConfig, rng: random.Random, drop: bool) -> tuple[
        Outcome, float]:
    """Send one streaming request; returns its outcome and how long to wait before the next (Retry-After)."""
    path, body = request_body(config, rng)
    started = time.perf_counter()
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                raw = await response.aread()
                outcome = Outcome(status=response.status_code, error=raw[:300].decode(errors="replace"))
                if response.status_code in REFUSALS:
                    outcome.refusal_ok = well_formed_refusal(response, raw)
                    wait = float(response.headers.get("retry-after", "1") or 1)
                    return outcome, min(wait, config.max_retry_wait_s) * (0.5 + rng.random())
                return outcome, 0.0
            return await _read_stream(response, started, drop), 0.0
    except httpx.HTTPError as error:
        return Outcome(status=0, error=f"{type(error).__name__}: {error}"), 0.0


async def _read_stream(response: httpx.Response, started: float, drop: bool) -> Outcome:
    outcome = Outcome(status=200)
    finished = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            outcome.complete = finished
            break
        event = json.loads(data)
        if "error" in event:
            outcome.error = json.dumps(event["error"])
            continue
        for choice in event.get("choices", []):
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text or choice.get("finish_reason"):
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - started
                outcome.tokens += 1 if text else 0
            finished = finished or bool(choice.get("finish_reason"))
        if drop and outcome.ttft_s is not None:
            outcome.disconnected = True
            return outcome  # leaving the `async with` closes the connection mid-stream
    outcome.e2e_s = time.perf_counter() - started
    return outcome


async def client_loop(http: httpx.AsyncClient, config: LoadConfig, index: int, deadline: float,
                      into: list[Outcome]) -> None:
    rng = random.Random(config.seed * 100_003 + index)
    await asyncio.sleep(rng.random() * 0.5)  # spread the first wave over half a second
    sent = 0
    while time.perf_counter() < deadline:
        sent += 1
        drop = config.disconnect_every > 0 and sent % config.disconnect_every == 0
        outcome, wait = await one_request(http, config, rng, drop)
        into.append(outcome)
        if wait:
            await asyncio.sleep(min(wait, max(deadline - time.perf_counter(), 0)))


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process in MiB (Linux /proc), None without a pid."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def engine_leftovers(url: str, api_key: str | None = None) -> dict[str, float]:
    """Sums of the gauges that must return to 0 once no request is in flight (from /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = ("sits_requests_running", "sits_requests_waiting", "sits_kv_cache_usage_ratio", "sits_admission_in_flight")
    totals = dict.fromkeys(names, 0.0)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def sits_serve(args: list[str], log_path: str, timeout_s: float = 300.0) -> Iterator[tuple[str, int]]:
    """`sits serve ARGS` on 127.0.0.1 and a free port until it is healthy; yields (url, pid); always stopped."""
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"sits serve exited with {process.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sits serve was not healthy within {timeout_s} s; see {log_path}")
                time.sleep(0.2)
            yield url, process.pid
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def warm_up(url: str, config: LoadConfig, requests: int = 4) -> None:
    """A few requests first, so the RSS baseline includes the allocator's steady state."""
    rng = random.Random(config.seed)
    for _ in range(requests):
        path, body = request_body(config, rng)
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        httpx.post(f"{url}{path}", json={**body, "stream": False}, headers=headers, timeout=config.request_timeout_s)


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


def compare(bounded: LoadReport, unbounded: LoadReport) -> str:
    """The bounded server's figures as ratios of its unbounded peer's, measured in the same run."""
    b, u = bounded.figures(), unbounded.figures()

    def ratio(key: str) -> str:
        return "n/a" if not b[key] or not u[key] else f"{b[key] / u[key]:.2f}x"

    growth_b = (b["rss_peak_mb"] or 0) - (b["rss_before_mb"] or 0)
    growth_u = (u["rss_peak_mb"] or 0) - (u["rss_before_mb"] or 0)
    return (f"bounded / unbounded queue: TTFT p50 {ratio('ttft_p50_s')}, p99 {ratio('ttft_p99_s')}; "
            f"e2e p50 {ratio('e2e_p50_s')}, p99 {ratio('e2e_p99_s')}; output tok/s {ratio('output_tokens_per_s')}; "
            f"RSS growth to peak {growth_b:.0f} MB vs {growth_u:.0f} MB")


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
