"""Score-based eviction: the order on scripted workloads matches t x (1 + alpha x priority)."""

from __future__ import annotations

import random

import pytest

from sits.runtime.engine.block_pool import BlockPool
from sits.runtime.engine.eviction import BlockOwner
from sits.runtime.tenancy.eviction import ScoreEvictionPolicy
from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy
from sits.runtime.tenancy.request_ids import RequestIdGenerator
from sits.runtime.tenancy.shards import ShardAccountant
from sits.runtime.tenancy.tenants import Tenant, TenantTable

ENGINE_START = 1_700_000_000.0


def request_id_at(seconds: float) -> str:
    """A real UUIDv7 made `seconds` after the engine started."""
    when_ns = int((ENGINE_START + seconds) * 1e9)
    return RequestIdGenerator(clock_ns=lambda: when_ns).new()


def used_at(seconds: float) -> float:
    """The last use (`KVBlock.last_used_time`) of a block last referenced by a request issued
    `seconds` after the engine started: the time its UUIDv7 carries (milliseconds)."""
    return BlockOwner(request_id_at(seconds)).issued_at


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_policy(shares, priorities, *, total=100, alpha=0.2, ttl_s=None, clock=None):
    shards = ShardAccountant(total, shares)
    policy = ScoreEvictionPolicy(shards, priorities, alpha=alpha, ttl_s=ttl_s, engine_start=ENGINE_START,
                                 clock=clock or FakeClock())
    return shards, policy


def test_scripted_workload_is_evicted_in_score_order():
    """Three tenants, all over share; blocks come back lowest t x (1 + 0.2 p) first."""
    rng = random.Random(3)
    priorities = {"gold": 3, "silver": 1, "bronze": 0}
    shards, policy = make_policy({t: 0.0 for t in priorities}, priorities)
    expected = {}
    for block_id in range(60):
        tenant = rng.choice(list(priorities))
        t = rng.uniform(0, 500)
        shards.allocate(tenant, 1)
        policy.block_cached(block_id, tenant, used_at(t))
        expected[block_id] = int(t * 1000) / 1000 * (1 + 0.2 * priorities[tenant])  # ids carry milliseconds
    order = []
    while (victim := policy.select_victim("bronze")) is not None:
        shards.release(victim.tenant, 1)
        assert victim.score == pytest.approx(expected[victim.block_id], abs=1e-6)
        order.append(victim.block_id)
    assert order == sorted(expected, key=lambda b: (expected[b], b))
    assert sum(policy.evictions_total.values()) == 60


def test_priority_keeps_blocks_longer():
    shards, policy = make_policy({"hi": 0.0, "lo": 0.0}, {"hi": 3, "lo": 0})
    for block_id, tenant, t in [(0, "hi", 100.0), (1, "lo", 150.0), (2, "lo", 170.0)]:
        shards.allocate(tenant, 1)
        policy.block_cached(block_id, tenant, used_at(t))
    # hi's block is older, but 100 x 1.6 = 160 > 150: lo's first block goes first.
    assert [policy.select_victim("lo").block_id for _ in range(3)] == [1, 0, 2]


def test_a_tenant_never_evicts_another_tenants_guaranteed_blocks():
    shards, policy = make_policy({"a": 0.5, "b": 0.5}, {}, total=6)
    t = {0: 50.0, 1: 60.0, 2: 70.0, 4: 10.0, 5: 20.0}
    for block_id, seconds in t.items():
        tenant = "a" if block_id < 4 else "b"
        assert shards.allocate(tenant, 1)
        policy.block_cached(block_id, tenant, used_at(seconds))
    assert not shards.can_allocate("a", 1)  # a holds its 3; the free block is b's
    # b asks: a is at (not over) its share, so only b's own blocks go, lowest score first.
    assert policy.select_victim("b").block_id == 4
    shards.release("b", 1)
    # a asks: b is under its share, so b's block 5 is never offered, though it scores lowest.
    victims = []
    while (victim := policy.select_victim("a")) is not None:
        victims.append(victim.block_id)
    assert victims == [0, 1, 2]
    assert 5 in policy


def test_over_share_blocks_go_before_the_requesters_own_even_with_lower_scores():
    shards, policy = make_policy({"a": 0.5, "b": 0.0}, {}, total=10)
    shards.allocate("a", 2)
    shards.allocate("b", 2)  # b borrows: over share
    policy.block_cached(0, "a", used_at(1.0))
    policy.block_cached(1, "a", used_at(2.0))
    policy.block_cached(2, "b", used_at(300.0))
    policy.block_cached(3, "b", used_at(400.0))
    assert policy.select_victim("a").block_id == 2  # b is over share: its blocks first
    shards.release("b", 1)
    assert policy.select_victim("a").block_id == 3
    shards.release("b", 1)
    assert policy.select_victim("a").block_id == 0  # then a's own, lowest score first


def test_blocks_past_the_ttl_go_first():
    clock = FakeClock()
    shards, policy = make_policy({"a": 0.0}, {"a": 0}, ttl_s=60.0, clock=clock)
    shards.allocate("a", 3)
    policy.block_cached(0, "a", used_at(500.0))  # released at clock 0, high score
    clock.now = 50.0
    policy.block_cached(1, "a", used_at(10.0))
    policy.block_cached(2, "a", used_at(20.0))
    clock.now = 70.0  # block 0 has been idle 70 s > TTL
    victim = policy.select_victim("a")
    assert (victim.block_id, victim.expired) == (0, True)
    assert policy.select_victim("a").block_id == 1
    clock.now = 200.0
    assert [v.block_id for v in policy.pop_expired()] == [2]
    assert len(policy) == 0


def test_rehit_blocks_leave_the_index_and_come_back_with_their_new_use():
    shards, policy = make_policy({"a": 0.0}, {}, total=10)
    shards.allocate("a", 2)
    policy.block_cached(0, "a", used_at(10.0))
    policy.block_cached(1, "a", used_at(20.0))
    policy.block_taken(0)  # a prefix hit references it again
    assert 0 not in policy and len(policy) == 1
    policy.block_cached(0, "a", used_at(30.0))  # released again by a later request
    assert [policy.select_victim("a").block_id for _ in range(2)] == [1, 0]
    assert policy.select_victim("a") is None


def test_lazy_invalidation_keeps_memory_bounded():
    shards, policy = make_policy({"a": 0.0}, {}, total=10)
    shards.allocate("a", 2)
    policy.block_cached(0, "a", used_at(1.0))
    for i in range(10_000):  # one block hit and released over and over
        policy.block_taken(1)
        policy.block_cached(1, "a", used_at(2.0 + i / 1000))
    blocks = policy._tenants["a"]
    assert len(blocks.by_t) + len(blocks.by_release) <= 4 * len(blocks.live) + 66
    assert policy.select_victim("a").block_id == 0


def test_ids_without_timestamps_count_as_used_now():
    policy = TenantEvictionPolicy(10, TenantTable([Tenant("a")]), engine_start=ENGINE_START)
    pool = BlockPool(10, eviction_policy=policy)
    (block,) = pool.allocate(1, BlockOwner("client-chosen-id", "a"))
    pool.cache(block, b"h" * 32)
    pool.release([block])
    assert policy.scores.block_score(block.block_id) > 1000  # time.time() - 2023's engine start
