"""KV shard accounting: guarantees, borrowing, and whose evictions help whom."""

from __future__ import annotations

import random

import pytest

from sits.runtime.tenancy.shards import ShardAccountant, ShardError


def test_guarantees_are_the_share_of_the_blocks_rounded_down():
    shards = ShardAccountant(100, {"a": 0.4, "b": 0.35, "c": 0.0})
    assert (shards.guaranteed("a"), shards.guaranteed("b"), shards.guaranteed("c")) == (40, 35, 0)
    assert shards.guaranteed("unlisted") == 0
    assert ShardAccountant(10, {"a": 0.3}).guaranteed("a") == 3  # 0.3 * 10 is 2.9999... in floats


def test_a_tenant_borrows_free_blocks_nobody_is_guaranteed():
    shards = ShardAccountant(100, {"a": 0.4, "b": 0.4})
    assert shards.headroom("a") == 60  # its 40 + the 20 unreserved; b's 40 stay b's
    assert shards.allocate("a", 60)
    assert shards.borrowed("a") == 20 and shards.is_over_share("a")
    assert not shards.allocate("a", 1)  # at its share + all borrowable: b's guarantee is untouchable
    assert shards.headroom("b") == 40 and shards.allocate("b", 40)
    assert shards.free_blocks == 0


def test_capacity_is_the_most_a_tenant_can_ever_hold():
    shards = ShardAccountant(100, {"a": 0.4, "b": 0.4, "c": 0.0})
    assert (shards.capacity("a"), shards.capacity("c"), shards.capacity("unlisted")) == (60, 20, 20)
    shards.allocate("b", 40)
    assert shards.capacity("a") == 60 == shards.headroom("a")  # capacity does not move with usage
    assert ShardAccountant(10, {"a": 0.5, "b": 0.5}).capacity("c") == 0  # shares take every block


def test_a_tenant_at_its_share_cannot_take_another_tenants_guaranteed_blocks():
    shards = ShardAccountant(10, {"a": 0.5, "b": 0.5})
    assert shards.allocate("a", 5)
    assert not shards.can_allocate("a", 1) and shards.shortfall("a", 2) == 2
    assert shards.allocate("b", 3)
    assert not shards.allocate("a", 1)  # 2 blocks are free, but they are b's
    assert shards.allocate("b", 2)


def test_releasing_and_evicting_change_headroom_as_documented():
    shards = ShardAccountant(10, {"a": 0.5, "b": 0.3})
    shards.allocate("a", 7)  # 5 guaranteed + 2 borrowed; b's 3 stay reserved
    shards.allocate("b", 3)
    assert shards.headroom("b") == 0
    # Evicting one of a's blocks (a is over share) helps b; evicting b's own helps b too.
    assert shards.eviction_helps("b", "a") and shards.eviction_helps("b", "b")
    shards.release("a", 1)
    assert shards.headroom("b") == 1
    shards.release("a", 1)  # a is back at its guarantee: its blocks no longer help b
    assert not shards.is_over_share("a") and not shards.eviction_helps("b", "a")
    shards.release("a", 1)
    assert shards.headroom("b") == 2  # the freed block is a's guarantee, not b's to take


def test_bookkeeping_errors_are_loud():
    shards = ShardAccountant(4, {"a": 1.0})
    with pytest.raises(ShardError):
        shards.release("a", 1)
    with pytest.raises(ValueError):
        ShardAccountant(4, {"a": 0.7, "b": 0.7})


def test_live_share_changes_apply_without_evicting():
    shards = ShardAccountant(10, {"a": 1.0})
    shards.allocate("a", 10)
    shards.set_shares({"a": 0.5, "b": 0.5})
    assert shards.is_over_share("a") and shards.borrowed("a") == 5
    assert shards.headroom("b") == 0 and shards.eviction_helps("b", "a")
    shards.release("a", 1)
    assert shards.allocate("b", 1)


def test_invariant_holds_under_random_workloads():
    """free >= every tenant's unfilled guarantee, whatever sequence of allocations succeeds."""
    rng = random.Random(7)
    shares = {"a": 0.3, "b": 0.25, "c": 0.2, "d": 0.0}
    shards = ShardAccountant(97, shares)
    for _ in range(5000):
        tenant = rng.choice(list(shares))
        if rng.random() < 0.55:
            count = rng.randint(1, 6)
            could = shards.can_allocate(tenant, count)
            assert shards.allocate(tenant, count) == could
        elif shards.held(tenant):
            shards.release(tenant, rng.randint(1, shards.held(tenant)))
        unfilled = sum(max(0, shards.guaranteed(t) - shards.held(t)) for t in shares)
        assert shards.free_blocks >= unfilled
        assert shards.used_blocks == sum(shards.held(t) for t in shares)
        for t in shares:  # each tenant can always reach its guarantee from free blocks
            assert shards.headroom(t) >= shards.guaranteed(t) - shards.held(t)
    snapshot = shards.snapshot()
    assert {t: u.held for t, u in snapshot.items()} == {t: shards.held(t) for t in snapshot}
