"""The tenant KV policy's bookkeeping on the engine's thread: its decisions and its CPU cost.

The real `KVCacheManager` with the tenants' `TenantEvictionPolicy` (shards and score-ordered
eviction) over a churn workload with no model: four tenants with different shares and priorities
send prompts drawn from a few per tenant (so prefix hits, cross-tenant pressure and evictions all
happen); each admitted prompt is computed and cached at once, then decodes `--decode` tokens (a new
block every `--block-size`); a bounded set of sequences runs and a random one is freed as others
arrive. Request ids are the server's form (`chatcmpl-<UUIDv7 hex>`), made on a clock that advances
a seeded random 0-40 ms per request, 5 % of them client-chosen (no time in them).

It prints two figures:
  - `digest`: a hash of every decision (which prefix hit, which blocks each allocation got or its
    refusal, every victim, the final shard usage and eviction counts). The workload is seeded, so
    two versions of the code that decide alike print the same digest: run it on both sides of a
    refactor that must not change behaviour;
  - thread CPU microseconds per request (admission, decode allocations, caching and freeing),
    median over `--runs`: what the bookkeeping costs the step loop.

    python benchmarks/bench_tenant_kv_policy.py [--requests 4000] [--runs 5]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from dataclasses import dataclass, field

from sits.runtime.engine.eviction import BlockOwner, KVBlock
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.sequence import Sequence
from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy
from sits.runtime.tenancy.request_ids import RequestIdGenerator
from sits.runtime.tenancy.tenants import Tenant, TenantTable

TABLE = TenantTable([Tenant("a", kv_cache_share=0.4, priority=2), Tenant("b", kv_cache_share=0.3),
                     Tenant("c", kv_cache_share=0.1, priority=1), Tenant("d")])
ENGINE_START = 1_700_000_000.0


class RecordingPolicy(TenantEvictionPolicy):
    """The real policy, remembering every victim it gave (None: it refused)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.victims: list[int | None] = []

    def pop_victim(self, requester: BlockOwner | None) -> KVBlock | None:
        block = super().pop_victim(requester)
        self.victims.append(None if block is None else block.block_id)
        return block


@dataclass
class Workload:
    """The seeded request stream: tenants, prompts, ids on a fake clock."""

    seed: int
    block_size: int
    now_ns: int = int((ENGINE_START + 10) * 1e9)
    rng: random.Random = field(init=False)
    ids: RequestIdGenerator = field(init=False)
    prompts: dict[str, list[list[int]]] = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.ids = RequestIdGenerator(clock_ns=lambda: self.now_ns)
        self.prompts = {t: [self.rng.sample(range(30_000), self.rng.randint(2, 12) * self.block_size
                                            + self.rng.randint(0, 3)) for _ in range(8)] for t in "abcd"}

    def request(self, index: int, max_tokens: int) -> Sequence:
        self.now_ns += self.rng.randint(0, 40_000_000)
        tenant = self.rng.choice("abcd")
        request_id = f"chatcmpl-{self.ids.new_uuid().hex}" if self.rng.random() < 0.95 else f"client-{index}"
        spec = TABLE.get(tenant)
        return Sequence(f"s{index}", request_id, 0, list(self.rng.choice(self.prompts[tenant])), SamplingParams(),
                        max_tokens=max_tokens, arrival_time=0.0, tenant=tenant, priority=spec.priority,
                        cache_salt=TABLE.prefix_salt(spec))


def decode(kv: KVCacheManager, seq: Sequence, tokens: int) -> None:
    """`tokens` decode steps' allocations (a new block whenever the last one is full)."""
    for _ in range(tokens):
        seq.all_token_ids.append(1)
        if kv.allocate(seq, 1) is None:
            return
        seq.num_computed_tokens += 1


def run(args: argparse.Namespace, seed: int) -> tuple[str, float]:
    """One pass of the workload: (decision digest, thread CPU µs per request)."""
    work = Workload(seed, args.block_size)
    policy = RecordingPolicy(args.num_blocks, TABLE, engine_start=ENGINE_START)
    kv = KVCacheManager(args.num_blocks, args.block_size, True, policy)
    running: list[Sequence] = []
    trace = []
    started = time.thread_time()
    for index in range(args.requests):
        if len(running) >= args.running:
            kv.free(running.pop(work.rng.randrange(len(running))))
        seq = work.request(index, args.decode)
        prefix = kv.find_prefix(seq)
        new = kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix)
        trace.append((prefix.num_tokens, None if new is None else tuple(new)))
        if new is not None:
            seq.num_computed_tokens = seq.num_tokens
            kv.cache_computed_blocks(seq)
            decode(kv, seq, args.decode)
            running.append(seq)
    micros = (time.thread_time() - started) / args.requests * 1e6
    usage = {t: (u.held, u.guaranteed, u.borrowed) for t, u in policy.usage().items()}
    decisions = repr((trace, policy.victims, usage, sorted(policy.evictions_total.items())))
    return f"{hashlib.sha256(decisions.encode()).hexdigest()[:16]} ({len(policy.victims)} victims)", micros


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=5, help="passes timed (the same seeded workload)")
    parser.add_argument("--num-blocks", type=int, default=400)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--running", type=int, default=12, help="sequences held at once")
    parser.add_argument("--decode", type=int, default=16, help="decode tokens per admitted sequence")
    args = parser.parse_args()
    results = [run(args, seed=1) for _ in range(args.runs)]
    digests = {digest for digest, _ in results}
    print(f"decisions digest {', '.join(sorted(digests))}; thread CPU µs per request: median "
          f"{statistics.median(m for _, m in results):.1f} (runs {[round(m, 1) for _, m in results]})")


if __name__ == "__main__":
    main()
