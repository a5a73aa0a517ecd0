"""Tenancy state-store overhead on CPU serving: `sits serve --state-store redis://` beside `memory://`.

Both servers run SmolLM2-135M-Instruct fp32 with the same tenants file: API keys, and a tenant with
requests- and tokens-per-minute limits (high enough never to refuse), so every request of the Redis
run makes its atomic rate-limit round trip to a real redis-server and its usage, token windows and
eviction index are written back in batches. The workload is `bench_cpu_serving.py`'s: concurrent
streamed chat requests through the openai client, greedy, a fixed number of output tokens. Rounds
alternate between the two servers, so drift in the machine's load hits both; the figure is the
median, over adjacent pairs of rounds, of the ratio of aggregate output tokens per second (target:
Redis >= 0.98 x memory). Other work on a shared machine makes wall-clock rounds noisy, so the CPU time
spent per output token (the sits process, plus redis-server's for the Redis store) is printed too:
it is what the store's overhead costs, whatever else runs.

With --side-by-side both servers are loaded at the same time in every round: they split the cores, other
work on the machine slows both alike, and the throughput ratio measures what one costs more than the other.

    python benchmarks/bench_tenancy_overhead.py [--rounds 8] [--side-by-side] [--concurrency 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from sits.runtime.tenancy.limits import RateLimiter
from sits.runtime.tenancy.memory_store import MemoryStateStore
from sits.runtime.tenancy.redis_store import RedisStateStore
from sits.runtime.tenancy.tenants import Tenant

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    # Import the `benchmarks` package from the repository root, then take the root off sys.path again:
    # its `operator/` and `kernels/` folders must not shadow the standard library's and others' modules.
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from benchmarks.bench_cpu_serving import QUESTIONS, sits_run, start_server  # noqa: E402
from benchmarks.run_report import cpu_name  # noqa: E402
from benchmarks.server_process import free_port, stop_process  # noqa: E402

API_KEY = "sk-bench-tenant"
TENANTS_YAML = f"""
tenants:
  - {{name: bench, apiKey: "{API_KEY}", priority: 2, kvCacheShare: 0.6,
     requestsPerMinute: 100000, tokensPerMinute: 100000000}}
  - {{name: other, apiKey: "sk-bench-other", kvCacheShare: 0.2}}
"""


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(workdir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return process
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.05)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Round:
    tokens_per_s: float
    cpu_s_per_1k_tokens: float  # sits serve's, plus redis-server's for the Redis store
    seconds_per_request: float  # wall time of the round / requests in it


async def tenancy_cost_per_request(redis_url: str, calls: int = 2000) -> dict[str, float]:
    """Seconds per request of what the serving path asks of each store: the RPM/TPM admission (one
    atomic script round trip on Redis) and the token and usage accounting (local, batched)."""
    tenant = Tenant("bench", requests_per_minute=10**9, tokens_per_minute=10**12)
    costs = {}
    for name, store in (("memory://", MemoryStateStore(deployment="bench-micro")),
                        ("redis://", RedisStateStore(redis_url, deployment="bench-micro"))):
        await store.start()
        limiter = RateLimiter(store)
        started = time.perf_counter()
        for _ in range(calls):
            await limiter.check(tenant, 0)
            limiter.record_tokens(tenant, 64)
            store.add_usage(tenant.name, requests=1, prompt_tokens=16, completion_tokens=64)
        costs[name] = (time.perf_counter() - started) / calls
        await store.close()
    return costs


def measure(targets: dict[str, tuple[int, list[int]]], model: str, prompts: list[str],
            max_tokens: int) -> dict[str, Round]:
    """One round on each target (store -> (port, pids to charge CPU to)), all of them at the same time."""
    before = {name: sum(cpu_seconds(pid) for pid in pids) for name, (_, pids) in targets.items()}

    async def both() -> list:
        return await asyncio.gather(*(sits_run(f"http://127.0.0.1:{port}/v1", model, prompts, max_tokens,
                                               api_key=API_KEY) for port, _ in targets.values()))

    results = {}
    for (name, (_, pids)), (run, _) in zip(targets.items(), asyncio.run(both()), strict=True):
        cpu = sum(cpu_seconds(pid) for pid in pids) - before[name]
        tokens = run.output_tokens + max_tokens  # sits_run's warm-up request is inside the CPU window
        results[name] = Round(run.tokens_per_s, 1000 * cpu / tokens, run.seconds / run.requests)
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds per store (in adjacent pairs)")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent chat requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--side-by-side", action="store_true",
                        help="load both servers at the same time each round (they split the cores, and "
                             "other work on the machine hits both alike) instead of one after the other")
    return parser.parse_args()


def run_rounds(args: argparse.Namespace, targets: dict[str, tuple[int, list[int]]], model: str,
               prompts: list[str]) -> dict[str, list[Round]]:
    """`args.rounds` measured rounds per store, printed as they end: {store: its rounds}."""
    rounds: dict[str, list[Round]] = {name: [] for name in targets}
    order = list(targets)
    for index in range(args.rounds):
        # Adjacent pairs, alternating which store goes first, so load drift hits both alike.
        names = order if index % 2 == 0 else list(reversed(order))
        groups = [names] if args.side_by_side else [[name] for name in names]
        for group in groups:
            for name, result in measure({n: targets[n] for n in group}, model, prompts, args.max_tokens).items():
                rounds[name].append(result)
                print(f"round {index + 1:>2}  {name:<10} {result.tokens_per_s:>7.1f} tok/s  "
                      f"{result.cpu_s_per_1k_tokens:>6.2f} CPU s / 1k tokens", flush=True)
    return rounds


def report(rounds: dict[str, list[Round]], costs: dict[str, float]) -> None:
    """The medians per store, the paired ratios and the tenancy work per request."""
    memory, shared = rounds["memory://"], rounds["redis://"]
    print(f"{'state store':<14}{'median tok/s':>14}{'median CPU s / 1k tokens':>28}")
    for name, results in rounds.items():
        print(f"{name:<14}{statistics.median(r.tokens_per_s for r in results):>14.1f}"
              f"{statistics.median(r.cpu_s_per_1k_tokens for r in results):>28.2f}")
    throughput = statistics.median(b.tokens_per_s / a.tokens_per_s for a, b in zip(memory, shared, strict=True))
    cpu = statistics.median(a.cpu_s_per_1k_tokens / b.cpu_s_per_1k_tokens for a, b in zip(memory, shared, strict=True))
    print(f"ratio (redis / memory), median of paired rounds: throughput {throughput:.3f}, "
          f"CPU efficiency {cpu:.3f} (target >= 0.98)")
    per_request = statistics.median(r.seconds_per_request for r in memory + shared)
    extra = costs["redis://"] - costs["memory://"]
    print(f"tenancy work per request: {costs['memory://'] * 1e6:.0f} us (memory), {costs['redis://'] * 1e6:.0f} us "
          f"(redis); a request's share of a round: {per_request * 1e3:.0f} ms -> Redis adds "
          f"{100 * extra / per_request:.3f}% per request")


def main() -> int:
    args = parse_args()
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.concurrency)]
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores)")
    print(f"{args.rounds} rounds per store of {args.concurrency} chat requests x {args.max_tokens} output tokens, "
          "SmolLM2-135M-Instruct fp32, greedy, tenant with RPM + TPM limits, "
          + ("both stores loaded at once" if args.side_by_side else "one store at a time"))
    print("load average (1/5/15 min) at the start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))

    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-tenancy-"))
    tenants = workdir / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    redis_port = free_port()
    redis_process = start_redis(redis_port, workdir)
    stores = {"memory://": "memory://", "redis://": f"redis://127.0.0.1:{redis_port}/0"}
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    try:
        for name, url in stores.items():
            port = free_port()
            log = open(workdir / f"serve-{name.strip(':/')}.log", "wb")  # noqa: SIM115 - lives with the server
            extra = ["--tenants", str(tenants), "--state-store", url, "--deployment", "bench"]
            servers[name] = (start_server(port, args.concurrency, log, extra), port)
        model = httpx.get(f"http://127.0.0.1:{servers['memory://'][1]}/v1/models",
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
        targets = {name: (port, [process.pid] + ([redis_process.pid] if name == "redis://" else []))
                   for name, (process, port) in servers.items()}
        rounds = run_rounds(args, targets, model, prompts)
        client = redis.Redis(port=redis_port)
        print(f"Redis holds usage of {len(client.keys('sits:bench:usage:*'))} replica(s) and "
              f"{len(client.keys('sits:bench:rl:*'))} rate-limit window(s)")
        costs = asyncio.run(tenancy_cost_per_request(stores["redis://"]))
    finally:
        for process, _ in servers.values():
            stop_process(process)
        stop_process(redis_process)
        shutil.rmtree(workdir, ignore_errors=True)
    report(rounds, costs)
    print("load average (1/5/15 min) at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
