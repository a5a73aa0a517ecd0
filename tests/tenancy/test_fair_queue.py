"""The fair waiting queue: priority tiers, weighted fair share, FCFS per tenant."""

from __future__ import annotations

from collections import Counter

import pytest

from sits.runtime.tenancy.fair_queue import FairQueue


class Req:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def drain(queue: FairQueue) -> list[str]:
    out = []
    while queue:
        out.append(queue.pop().name)
    return out


def test_a_flood_delays_another_tenants_request_by_at_most_one_round():
    queue = FairQueue()
    for i in range(1000):
        queue.push(Req(f"flood{i}"), "flooder")
    queue.pop()
    queue.pop()  # the flood is being served
    queue.push(Req("single"), "victim")
    served = [queue.pop().name for _ in range(2)]
    assert "single" in served


def test_one_request_of_each_of_many_tenants_goes_before_the_floods_next():
    queue = FairQueue()
    for i in range(50):
        queue.push(Req(f"f{i}"), "flooder")
    for tenant in ("t1", "t2", "t3"):
        queue.push(Req(tenant), tenant)
    served = [queue.pop().name for _ in range(5)]
    assert {"t1", "t2", "t3"} <= set(served)


def test_weights_split_service_between_backlogged_tenants():
    queue = FairQueue({"big": 3.0, "small": 1.0})
    for i in range(400):
        queue.push(Req(f"big{i}"), "big")
        queue.push(Req(f"small{i}"), "small")
    first = Counter(queue.pop().name.rstrip("0123456789") for _ in range(200))
    assert first["big"] == pytest.approx(150, abs=2) and first["small"] == pytest.approx(50, abs=2)


def test_cost_is_charged_so_big_prompts_get_fewer_turns():
    queue = FairQueue()
    for i in range(100):
        queue.push(Req(f"long{i}"), "long", cost=1000)
        queue.push(Req(f"short{i}"), "short", cost=100)
    first = Counter(queue.pop().name.rstrip("0123456789") for _ in range(44))
    assert first["short"] == pytest.approx(40, abs=1)


def test_higher_priority_tiers_always_go_first_and_each_tenant_stays_fcfs():
    queue = FairQueue()
    queue.push(Req("low1"), "a", priority=0)
    queue.push(Req("low2"), "a", priority=0)
    queue.push(Req("mid"), "b", priority=1)
    queue.push(Req("high"), "c", priority=3)
    assert queue.peek().name == "high"
    assert drain(queue) == ["high", "mid", "low1", "low2"]


def test_idle_tenants_save_no_credit():
    queue = FairQueue()
    for i in range(10):
        queue.push(Req(f"a{i}"), "a")
    for _ in range(10):
        queue.pop()  # b was idle the whole time
    for i in range(10):
        queue.push(Req(f"a{10 + i}"), "a")
        queue.push(Req(f"b{i}"), "b")
    first_ten = [queue.pop().name[0] for _ in range(10)]
    assert Counter(first_ten) == {"a": 5, "b": 5}  # alternating, not ten b's in a row


def test_push_front_puts_a_preempted_request_next_in_its_tier():
    queue = FairQueue()
    for i in range(3):
        queue.push(Req(f"a{i}"), "a")
        queue.push(Req(f"b{i}"), "b")
    first = queue.pop()
    queue.push_front(first, "a")
    assert queue.pop() is first
    queue.push(Req("top"), "c", priority=2)
    preempted = Req("preempted")
    queue.push_front(preempted, "b", priority=0)
    assert [queue.pop().name for _ in range(2)] == ["top", "preempted"]


def test_remove_len_contains_and_iteration():
    queue = FairQueue()
    reqs = [Req(f"r{i}") for i in range(6)]
    for i, req in enumerate(reqs):
        queue.push(req, "ab"[i % 2], priority=i % 3)
    assert len(queue) == 6 and reqs[2] in queue
    assert queue.remove(reqs[2]) and not queue.remove(reqs[2])
    assert reqs[2] not in queue and len(queue) == 5
    assert sorted(r.name for r in queue) == ["r0", "r1", "r3", "r4", "r5"]
    assert queue.remove(reqs[5])
    assert sorted(drain(queue)) == ["r0", "r1", "r3", "r4"]
    with pytest.raises(IndexError):
        queue.pop()
    with pytest.raises(IndexError):
        queue.peek()


def test_removing_a_tenants_whole_backlog_lets_others_through():
    queue = FairQueue()
    a_reqs = [Req(f"a{i}") for i in range(5)]
    for req in a_reqs:
        queue.push(req, "a")
    queue.push(Req("b0"), "b")
    for req in a_reqs:
        queue.remove(req)
    assert drain(queue) == ["b0"]
    queue.push(Req("a-again"), "a")
    assert drain(queue) == ["a-again"]


def test_the_same_item_cannot_wait_twice():
    queue = FairQueue()
    req = Req("x")
    queue.push(req, "a")
    with pytest.raises(ValueError):
        queue.push(req, "b")


def test_heads_lists_one_request_per_tenant_in_service_order_and_take_skips_a_blocked_tenant():
    queue = FairQueue()
    for i in range(3):
        queue.push(Req(f"a{i}"), "a")
    queue.push(Req("b0"), "b")
    queue.push(Req("vip"), "v", priority=2)
    assert [r.name for r in queue.heads()] == ["vip", "a0", "b0"]
    assert [r.name for r in queue.heads()] == [r.name for r in queue.heads()]  # no side effects
    heads = list(queue.heads())
    queue.take(heads[0])
    queue.take(heads[2])  # a's head cannot run now (say its shard is full): b goes ahead
    assert [r.name for r in queue.heads()] == ["a0"]
    with pytest.raises(ValueError, match="head"):
        queue.take(next(r for r in queue if r.name == "a1"))
    assert drain(queue) == ["a0", "a1", "a2"]
