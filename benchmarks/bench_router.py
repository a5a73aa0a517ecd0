"""`sits router` policies compared on one multi-tenant, multi-turn workload, on CPU with SmolLM2.

Starts Redis, N replicas (`sits serve`, the embedded SmolLM2-135M) and, for each policy in turn,
fresh replicas and a router with that policy; then replays the same workload through the router:

- T tenants, each with its own long system prompt (about L tokens, seeded text);
- U users per tenant, each holding a K-turn conversation: a user thinks for an exponential time
  (so the arrivals of all users form a Poisson process of the given rate), sends the conversation so
  far, streams the answer, appends it and goes on.

Reports per policy: TTFT p50 / p90, output tokens per second over the phase, the prefix-cache hit
rate from the replicas' /metrics (hit tokens / prompt tokens), the ideal rate (each tenant's blocks
computed once, with an unbounded cache: from the prompts' own block hashes) and cross-tenant hits.

    python -m benchmarks.bench_router --tenants 12 --users 3 --turns 3 --system-tokens 1000 --rate 2
    python -m benchmarks.bench_router --tenants 6 --users 2 --turns 2 --system-tokens 300  # reduced
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sits.runtime.engine.stats import PrefixCacheCounts
from sits.runtime.router.prompt import PromptHasher, load_tokenizer
from sits.runtime.tenancy.tenants import load_tenants_file

POLICIES = ("round-robin", "least-loaded", "approximate", "precise")
WORDS = ("invoice", "refund", "shipment", "ledger", "audit", "policy", "customer", "contract", "warranty", "region",
         "quota", "premium", "account", "balance", "transfer", "dispute", "escrow", "tariff", "clause", "renewal",
         "discount", "loyalty", "voucher", "carrier", "parcel")
QUESTIONS = ("What changed in my last invoice?", "Can you explain that in simpler words?",
             "What should I do next?", "Is there a deadline for this?", "Summarise our conversation.")


Prompt = tuple[str, list[dict], bool]  # (tenant, conversation, sent as a prompt: else an answer the replica cached)


@dataclass
class Args:
    replicas: int
    tenants: int
    users: int
    turns: int
    system_tokens: int
    rate: float
    max_tokens: int
    num_blocks: int
    max_num_seqs: int
    policies: list[str]
    seed: int
    out: Path | None


@dataclass
class Phase:
    """One policy's run: TTFTs (s), tokens out, failed requests, wall time (s), and the replicas'
    prefix-cache figures summed (prompt tokens), beside the ideal hit rate and the router's decisions."""

    policy: str
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    failures: int = 0
    wall_s: float = 0.0
    prefix: PrefixCacheCounts = field(default_factory=PrefixCacheCounts)
    ideal_hit_rate: float = 0.0
    decisions: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Hit tokens / prompt tokens looked up, over all replicas (0 before any lookup)."""
        return self.prefix.hits / self.prefix.queries if self.prefix.queries else 0.0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become ready")


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tenants_yaml(count: int) -> tuple[str, dict[str, str]]:
    keys = {f"t{i:02d}": f"sk-bench-{i:02d}-{random.Random(i).getrandbits(48):012x}" for i in range(count)}
    lines = ["tenants:"] + [f'  - {{name: {name}, apiKey: "{key}"}}' for name, key in keys.items()]
    return "\n".join(lines) + "\n", keys


def system_prompt(tenant: str, tokens: int, seed: int) -> str:
    rng = random.Random(f"{seed}/{tenant}")
    words = " ".join(rng.choice(WORDS) for _ in range(tokens))  # ~1 token per word
    return f"You are the assistant of {tenant}. Company handbook follows. {words}"


def metric_sum(url: str, name: str) -> float:
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def decisions(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sits_router_requests_total":
                label = sample.labels["policy_decision"]
                totals[label] = totals.get(label, 0.0) + sample.value
    return totals


async def user_session(http: httpx.AsyncClient, url: str, key: str, system: str, user: int, args: Args,
                       rng: random.Random, phase: Phase, prompts: list[Prompt], tenant: str) -> None:
    messages = [{"role": "system", "content": system}]
    per_user_rate = args.rate / (args.tenants * args.users)
    for turn in range(args.turns):
        await asyncio.sleep(rng.expovariate(per_user_rate))
        messages.append({"role": "user", "content": f"(user {user}) {QUESTIONS[turn % len(QUESTIONS)]}"})
        prompts.append((tenant, list(messages), True))
        body = {"messages": messages, "max_tokens": args.max_tokens,
                "temperature": 0.7, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        started, first, text = time.perf_counter(), None, []
        try:
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"}) as response:
                if response.status_code != 200:
                    phase.failures += 1
                    await response.aread()
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        phase.output_tokens += event["usage"]["completion_tokens"]
                    for choice in event.get("choices", []):
                        if choice["delta"].get("content"):
                            first = first or time.perf_counter()
                            text.append(choice["delta"]["content"])
        except httpx.HTTPError:
            phase.failures += 1
            continue
        if first is not None:
            phase.ttft_s.append(first - started)
        messages.append({"role": "assistant", "content": "".join(text)})
        prompts.append((tenant, list(messages), False))  # the replica also caches the answer's blocks


def ideal_hit_rate(prompts: list[Prompt], hasher: PromptHasher, salts: dict[str, str]) -> float:
    """Hit tokens / prompt tokens with an unbounded cache and each tenant's blocks computed once
    (a finished turn's answer counts as cached, as on a replica)."""
    seen: set[bytes] = set()
    hits = total = 0
    for tenant, messages, is_prompt in prompts:
        body = {"messages": messages, **({} if is_prompt else {"add_generation_prompt": False})}
        prompt = hasher.prompt_ids("/v1/chat/completions", body)
        if prompt is None:
            continue
        ids = prompt[0]
        key = hasher.key(ids, salts[tenant], None)
        if not is_prompt:
            seen.update(key.block_hashes)
            continue
        matched = 0
        for block_hash in key.block_hashes:
            if block_hash not in seen:
                break
            matched += 1
        seen.update(key.block_hashes)
        hits += matched * hasher.block_size
        total += len(ids)
    return hits / total if total else 0.0


async def run_workload(url: str, keys: dict[str, str], args: Args, phase: Phase,
                       prompts: list[Prompt]) -> None:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        sessions = [user_session(http, url, keys[tenant], system_prompt(tenant, args.system_tokens, args.seed), user,
                                 args, random.Random(rng.random()), phase, prompts, tenant)
                    for tenant in keys for user in range(args.users)]
        started = time.perf_counter()
        await asyncio.gather(*sessions)
        phase.wall_s = time.perf_counter() - started


def run_policy(policy: str, args: Args, workdir: Path, tenants_file: Path, keys: dict[str, str], redis_port: int,
               hasher: PromptHasher, salts: dict[str, str]) -> Phase:
    deployment = f"bench-{policy}"
    processes: list[subprocess.Popen] = []
    phase = Phase(policy)
    try:
        urls, metrics_urls = [], []
        metrics_port = free_port()  # every replica's --metrics-port, as pods share one: one loopback address each
        for index in range(args.replicas):
            host, port = f"127.0.0.{index + 2}", free_port()
            argv = [sys.executable, "-m", "sits.runtime", "serve", "--device", "cpu", "--host", host,
                    "--port", str(port), "--metrics-port", str(metrics_port),
                    "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
                    "--max-model-len", str(min(4096, 16 * args.num_blocks)), "--tenants", str(tenants_file),
                    "--state-store", f"redis://127.0.0.1:{redis_port}/0", "--deployment", deployment,
                    "--log-level", "warning"]
            processes.append(start(argv, workdir / f"{policy}-replica{index}.log"))
            urls.append(f"http://{host}:{port}")
            metrics_urls.append(f"http://{host}:{metrics_port}")
        for url, process in zip(urls, processes, strict=True):
            wait_ready(url, process)
        router_port = free_port()
        router = start([sys.executable, "-m", "sits.runtime.router", "--port", str(router_port), "--policy", policy,
                        "--state-store", f"redis://127.0.0.1:{redis_port}/0", "--deployment", deployment,
                        "--tenants", str(tenants_file), "--log-level", "warning",
                        "--replica-metrics-port", str(metrics_port),
                        *[a for url in urls for a in ("--replica", url)]], workdir / f"{policy}-router.log")
        processes.append(router)
        router_url = f"http://127.0.0.1:{router_port}"
        wait_ready(router_url, router, timeout_s=120)
        prompts: list[Prompt] = []
        asyncio.run(run_workload(router_url, keys, args, phase, prompts))
        # with --tenants a replica serves /metrics on its --metrics-port only
        phase.prefix = PrefixCacheCounts(
            queries=int(sum(metric_sum(u, "sits_prefix_cache_queries_total") for u in metrics_urls)),
            hits=int(sum(metric_sum(u, "sits_prefix_cache_hits_total") for u in metrics_urls)),
            cross_tenant_hits=int(sum(metric_sum(u, "sits_prefix_cache_cross_tenant_hits_total") for u in metrics_urls)))
        phase.ideal_hit_rate = ideal_hit_rate(prompts, hasher, salts)
        phase.decisions = decisions(router_url)
    finally:
        for process in reversed(processes):
            stop(process)
    return phase


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def report(phases: list[Phase], args: Args) -> str:
    lines = [f"bench_router: {args.replicas} replicas (SmolLM2-135M, CPU), {args.tenants} tenants x {args.users} users "
             f"x {args.turns} turns, system prompt ~{args.system_tokens} tokens, {args.rate}/s Poisson, "
             f"max_tokens {args.max_tokens}, {args.num_blocks} KV blocks per replica", "",
             "| policy | TTFT p50 (s) | TTFT p90 (s) | output tok/s | prefix hit rate | ideal | cross-tenant hits "
             "| failed | decisions |", "|---|---|---|---|---|---|---|---|---|"]
    for p in phases:
        decided = ", ".join(f"{k} {int(v)}" for k, v in sorted(p.decisions.items()))
        lines.append(f"| {p.policy} | {percentile(p.ttft_s, 50):.2f} | {percentile(p.ttft_s, 90):.2f} | "
                     f"{p.output_tokens / p.wall_s if p.wall_s else 0:.1f} | {p.hit_rate:.3f} | {p.ideal_hit_rate:.3f} "
                     f"| {p.prefix.cross_tenant_hits} | {p.failures} | {decided} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--users", type=int, default=3, help="users per tenant")
    parser.add_argument("--turns", type=int, default=3, help="turns per user")
    parser.add_argument("--system-tokens", type=int, default=1000, help="approximate system prompt length")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second, all users together")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks per replica (16 tokens each)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    ns = parser.parse_args(argv)
    policies = [p.strip() for p in ns.policies.split(",") if p.strip()]
    if unknown := set(policies) - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    return Args(ns.replicas, ns.tenants, ns.users, ns.turns, ns.system_tokens, ns.rate, ns.max_tokens, ns.num_blocks,
                ns.max_num_seqs, policies, ns.seed, ns.out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="sits-bench-router-"))
    text, keys = tenants_yaml(args.tenants)
    tenants_file = workdir / "tenants.yaml"
    tenants_file.write_text(text)
    table = load_tenants_file(tenants_file)
    salts = {name: table.prefix_salt(table.get(name)) for name in keys}  # type: ignore[arg-type]
    hasher = PromptHasher(load_tokenizer(None), block_size=16)
    redis_port = free_port()
    redis = start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                   "no"], workdir / "redis.log")
    phases = []
    try:
        for policy in args.policies:
            phase = run_policy(policy, args, workdir, tenants_file, keys, redis_port, hasher, salts)
            print(f"{policy}: done in {phase.wall_s:.1f} s", file=sys.stderr, flush=True)
            phases.append(phase)
    finally:
        stop(redis)
    table_text = report(phases, args)
    print(table_text)
    if args.out:
        args.out.write_text(table_text + "\n")
    print(f"logs: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
