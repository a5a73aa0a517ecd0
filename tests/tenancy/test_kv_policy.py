"""The tenant eviction policy inside the engine's real KV-cache manager and block pool."""

from __future__ import annotations

import random

import pytest

from sits.runtime.engine.eviction import BlockOwner
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.sequence import Sequence
from sits.runtime.tenancy.request_ids import RequestIdGenerator
from sits.runtime.tenancy.tenants import Tenant, TenantTable
from tests.tenancy.recording_policy import RecordingPolicy

ENGINE_START = 1_700_000_000.0
BLOCK = 4


def request_id_at(seconds: float) -> str:
    when_ns = int((ENGINE_START + seconds) * 1e9)
    return RequestIdGenerator(clock_ns=lambda: when_ns).new()


class Cache:
    """A KVCacheManager with the tenant policy, and helpers to run sequences through it."""

    def __init__(self, table: TenantTable, num_blocks: int, **policy_options) -> None:
        self.table = table
        self.policy = RecordingPolicy(num_blocks, table, engine_start=ENGINE_START, **policy_options)
        self.kv = KVCacheManager(num_blocks, BLOCK, True, self.policy)
        self.count = 0

    def sequence(self, tenant: str, tokens: list[int], at: float, shared: bool = False) -> Sequence:
        self.count += 1
        t = self.table.get(tenant)
        return Sequence(seq_id=f"s{self.count}", request_id=request_id_at(at), index=0, prompt_token_ids=tokens,
                        params=SamplingParams(max_tokens=1), max_tokens=1, arrival_time=at, tenant=tenant,
                        priority=t.priority, cache_salt=self.table.prefix_salt(t, shared))

    def run(self, seq: Sequence) -> list[int] | None:
        """Admit the prompt (with its prefix hit), compute it, cache its full blocks."""
        prefix = self.kv.find_prefix(seq)
        new = self.kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix)
        if new is None:
            return None
        seq.num_computed_tokens = seq.num_tokens
        self.kv.cache_computed_blocks(seq)
        return new

    def check_accounting(self) -> None:
        """Shard counts equal the pool's truth: referenced + cached blocks per tenant."""
        held = sum(u.held for u in self.policy.usage().values())
        assert held == self.kv.num_blocks - len(self.kv.pool._empty)


def tokens(seed: int, n: int = 3 * BLOCK + 1) -> list[int]:
    return random.Random(seed).sample(range(1000), n)


def test_eviction_order_on_a_scripted_workload_matches_the_score():
    table = TenantTable([Tenant("gold", priority=3), Tenant("silver", priority=1), Tenant("bronze")])
    cache = Cache(table, num_blocks=40)
    rng = random.Random(11)
    expected_scores = {}
    for i in range(12):  # 12 finished prompts x 3 full cached blocks + 1 private block each
        tenant = rng.choice(["gold", "silver", "bronze"])
        at = rng.uniform(1, 900)
        seq = cache.sequence(tenant, tokens(i), at)
        assert cache.run(seq) is not None
        blocks = cache.kv.block_ids(seq.seq_id)
        cache.kv.free(seq)
        score = int(at * 1000) / 1000 * (1 + 0.2 * table.get(tenant).priority)
        expected_scores.update({b: score for b in blocks[:3]})
    assert len(cache.policy) == 36
    cache.check_accounting()
    # One long prompt needs every block: evictions happen, lowest score first.
    big = cache.sequence("bronze", tokens(99, 40 * BLOCK - 1), at=1000.0)
    evicted_before = cache.kv.pool.num_evictions
    assert cache.run(big) is not None
    assert cache.kv.pool.num_evictions - evicted_before == 36
    scores_in_order = [expected_scores[b] for b in cache.policy.victims]
    assert scores_in_order == sorted(scores_in_order)
    assert sum(cache.policy.evictions_total.values()) == 36
    cache.check_accounting()


def test_zero_cross_tenant_prefix_hits_unless_marked_shared():
    table = TenantTable([Tenant("a"), Tenant("b")], shared_prefix_pool=True)
    cache = Cache(table, num_blocks=32)
    prompt = tokens(5)
    first = cache.sequence("a", prompt, 1.0)
    cache.run(first)
    cache.kv.free(first)
    other_tenant = cache.sequence("b", prompt, 2.0)
    assert cache.kv.find_prefix(other_tenant).num_tokens == 0  # same tokens, other tenant: no hit
    same_tenant = cache.sequence("a", prompt, 3.0)
    assert cache.kv.find_prefix(same_tenant).num_tokens == 3 * BLOCK
    marked = cache.sequence("a", prompt, 4.0, shared=True)
    cache.run(marked)
    cache.kv.free(marked)
    assert cache.kv.find_prefix(cache.sequence("b", prompt, 5.0, shared=True)).num_tokens == 3 * BLOCK
    assert cache.kv.find_prefix(cache.sequence("b", prompt, 6.0)).num_tokens == 0


def test_a_tenant_at_its_share_cannot_evict_another_tenants_guaranteed_cache():
    table = TenantTable([Tenant("a", kv_cache_share=0.5), Tenant("b", kv_cache_share=0.5)])
    cache = Cache(table, num_blocks=8)
    b_seq = cache.sequence("b", tokens(1, 3 * BLOCK), 1.0)  # 3 blocks, all cacheable
    cache.run(b_seq)
    cache.kv.free(b_seq)  # b's cache: 3 blocks within its guarantee of 4
    a_seq = cache.sequence("a", tokens(2, 4 * BLOCK), 2.0)
    assert cache.run(a_seq) is not None  # a takes its 4
    greedy = cache.sequence("a", tokens(3, 2 * BLOCK), 3.0)
    # One empty block is left and b's cached blocks are b's guarantee: a gets nothing more.
    assert not cache.policy.may_take_empty(BlockOwner(greedy.request_id, "a"))
    assert cache.run(greedy) is None
    assert cache.policy.usage()["b"].held == 3
    assert len(cache.policy) == 3  # b's cache is intact
    cache.check_accounting()


def test_over_share_tenants_lose_their_cache_first():
    table = TenantTable([Tenant("a", kv_cache_share=0.25), Tenant("b", kv_cache_share=0.25)])
    cache = Cache(table, num_blocks=8)
    old_b = cache.sequence("b", tokens(1, 2 * BLOCK), 1.0)  # b: 2 blocks, within its share
    cache.run(old_b)
    cache.kv.free(old_b)
    young_a = cache.sequence("a", tokens(2, 6 * BLOCK), 50.0)  # a: 6 blocks, 4 borrowed
    cache.run(young_a)
    cache.kv.free(young_a)
    assert cache.policy.usage()["a"].borrowed == 4
    # b needs a block: a is over its share, so a's block goes although b's are older (lower score).
    new_b = cache.sequence("b", tokens(3, BLOCK), 60.0)
    assert cache.run(new_b) is not None
    assert cache.policy.evictions_total == {"a": 1}
    assert len(cache.policy) == 7  # b's 2 cached blocks and 5 of a's remain
    assert cache.kv.find_prefix(cache.sequence("b", tokens(1, 2 * BLOCK), 70.0)).num_tokens == BLOCK
    cache.check_accounting()


def test_reset_prefix_cache_empties_the_index_and_the_shards():
    table = TenantTable([Tenant("a", kv_cache_share=0.5)])
    cache = Cache(table, num_blocks=8)
    seq = cache.sequence("a", tokens(1, 4 * BLOCK), 1.0)
    cache.run(seq)
    cache.kv.free(seq)
    assert cache.policy.usage()["a"].held == 4
    assert cache.kv.reset_prefix_cache() == 4
    assert len(cache.policy) == 0 and cache.policy.shards.used_blocks == 0


def test_live_table_updates_change_shares_and_scores():
    table = TenantTable([Tenant("a", kv_cache_share=0.5), Tenant("b")])
    cache = Cache(table, num_blocks=10)
    cache.policy.apply_table(TenantTable([Tenant("a", kv_cache_share=0.2, priority=2), Tenant("b")]))
    assert cache.policy.shards.guaranteed("a") == 5  # handed over, applied on the engine's next allocation
    cache.run(cache.sequence("b", tokens(1, BLOCK), 1.0))
    assert cache.policy.shards.guaranteed("a") == 2
    assert cache.policy.scores.score("a", 10.0) == pytest.approx(14.0)


def test_eviction_index_entry_for_the_state_store():
    table = TenantTable([Tenant("a", kv_cache_share=0.5)])
    cache = Cache(table, num_blocks=8)
    seq = cache.sequence("a", tokens(1, 2 * BLOCK + 1), 10.0)
    cache.run(seq)
    cache.kv.free(seq)
    entry = cache.policy.eviction_index()["a"]
    assert (entry.cached_blocks, entry.held_blocks, entry.guaranteed_blocks) == (2, 2, 4)
    assert entry.lowest_score == pytest.approx(10.0)


def test_a_tenant_past_its_headroom_evicts_its_own_cache_instead_of_reserved_empty_blocks():
    table = TenantTable([Tenant("a", kv_cache_share=0.5), Tenant("b", kv_cache_share=0.5)])
    cache = Cache(table, num_blocks=8)
    old = cache.sequence("a", tokens(1, 4 * BLOCK), 1.0)
    cache.run(old)
    cache.kv.free(old)  # a's share is all cache now; b's 4 blocks are empty
    new = cache.sequence("a", tokens(2, 2 * BLOCK), 2.0)
    assert cache.run(new) is not None  # served by evicting a's own blocks...
    assert cache.policy.evictions_total == {"a": 2}
    assert len(cache.kv.pool._empty) == 4  # ...while b's reserved empty blocks stay untouched
    cache.check_accounting()


def test_guarantees_and_accounting_hold_under_a_random_workload():
    table = TenantTable([Tenant("a", kv_cache_share=0.4, priority=2), Tenant("b", kv_cache_share=0.3),
                         Tenant("c", kv_cache_share=0.0, priority=1)])
    cache = Cache(table, num_blocks=30)
    rng = random.Random(17)
    running: list[Sequence] = []
    prompts = {t: [tokens(100 * i + j, rng.randint(BLOCK, 5 * BLOCK)) for j in range(4)]
               for i, t in enumerate("abc")}
    for step in range(600):
        if running and rng.random() < 0.45:
            cache.kv.free(running.pop(rng.randrange(len(running))))
        else:
            tenant = rng.choice("abc")
            seq = cache.sequence(tenant, rng.choice(prompts[tenant]), float(step))
            if cache.run(seq) is not None:
                running.append(seq)
        shards = cache.policy.shards
        unfilled = sum(max(0, shards.guaranteed(t) - shards.held(t)) for t in "abc")
        assert len(cache.kv.pool._empty) >= unfilled  # every guarantee can still be met
        holders = [h for h in map(cache.kv.pool.holder_of, cache.kv.pool.blocks) if h is not None]
        assert {t: holders.count(t) for t in "abc"} == {t: shards.held(t) for t in "abc"}
        assert len(cache.policy) == sum(cache.policy.scores.cached_blocks(t) for t in "abc")
    assert sum(cache.policy.evictions_total.values()) > 0
