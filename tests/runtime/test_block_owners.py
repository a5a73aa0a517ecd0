"""The block pool's owner map: who holds and who uses each block, the one record the tenancy layer reads."""

from __future__ import annotations

import random

import pytest

from sits.runtime.engine.block_owners import TenantCounts
from sits.runtime.engine.block_pool import BlockPool
from sits.runtime.engine.eviction import BlockOwner
from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy
from sits.runtime.tenancy.request_ids import RequestIdGenerator
from sits.runtime.tenancy.shards import ShardError
from sits.runtime.tenancy.tenants import Tenant, TenantTable


def test_holders_follow_blocks_until_they_are_empty_and_users_while_referenced():
    pool = BlockPool(4)
    a_blocks = pool.allocate(2, BlockOwner("r1", "a"))
    pool.cache(a_blocks[0], b"h" * 32)
    pool.release(reversed(a_blocks))  # one cached (still a's), one empty again
    assert pool.held_blocks_by_tenant() == {"a": 1} and pool.used_blocks_by_tenant() == {}
    pool.touch([a_blocks[0]], BlockOwner("r2", "b"))  # b's hit: b uses it, a still holds it
    assert pool.holder_of(a_blocks[0]) == "a" and pool.used_blocks_by_tenant() == {"b": 1}
    with pytest.raises(RuntimeError, match="already held"):
        pool.owners.charge(a_blocks[0].block_id, "b")


def test_the_tally_keeps_the_shortfall_below_its_floors_in_step():
    rng = random.Random(5)
    counts = TenantCounts()
    floors = {"a": 5, "b": 3}
    counts.set_floors(floors)
    for _ in range(2000):
        tenant = rng.choice("abc")
        counts.add(tenant, 1 if rng.random() < 0.6 or counts.get(tenant) == 0 else -1)
        if rng.random() < 0.01:
            floors = {"a": rng.randint(0, 9), "c": rng.randint(0, 9)}
            counts.set_floors(floors)
        assert counts.shortfall == sum(max(0, f - counts.get(t)) for t, f in floors.items())
        assert counts.total == sum(counts.snapshot().values())


def test_the_tenant_policys_shards_read_the_pools_owner_map():
    policy = TenantEvictionPolicy(8, TenantTable([Tenant("a", kv_cache_share=0.5), Tenant("b")]))
    pool = BlockPool(8, eviction_policy=policy)
    assert pool.owners is policy.owners
    blocks = pool.allocate(3, BlockOwner("r", "a"))
    assert policy.shards.held("a") == 3 and policy.shards.headroom("b") == 4  # a's 1 unfilled block stays a's
    pool.release(blocks)
    assert policy.shards.held("a") == 0
    with pytest.raises(ShardError, match="owner map"):
        policy.shards.allocate("a", 1)  # only the pool charges a pool's map
    with pytest.raises(RuntimeError, match="already serves"):
        BlockPool(8, eviction_policy=policy)


def test_a_blocks_last_use_is_the_issue_time_of_the_request_that_last_referenced_it():
    def issued(unix_s: float) -> str:
        return RequestIdGenerator(clock_ns=lambda: int(unix_s * 1e9)).new()

    pool = BlockPool(2)
    (block,) = pool.allocate(1, BlockOwner(issued(1_700_000_100.0)))
    pool.cache(block, b"h" * 32)
    pool.touch([block], BlockOwner(issued(1_700_000_050.0)))  # an older request hits it later
    pool.release([block, block])
    assert block.last_used_time == pytest.approx(1_700_000_050.0)
    pool.touch([block], BlockOwner("client-chosen"))
    assert block.last_used_time is None  # unknown: the tenant policy counts it as used now
