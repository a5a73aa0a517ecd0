"""The scheduler's waiting queue, fair between tenants: strict priority tiers, weighted fair share inside.

A drop-in for the FCFS deque of a continuous-batching scheduler (`peek` / `pop` / `push_front` /
`remove` / `len` / `bool` / `in`): within one tenant requests stay FCFS; between tenants of one
priority tier it is start-time fair queuing (SFQ). Each backlogged tenant carries a virtual start
tag; the head of the tenant with the smallest tag goes next, and serving a request of cost c
advances its tenant's tag by c / weight. A tenant that was idle starts at the tier's current
virtual time, never with credit saved up, so a flood from one tenant delays another tenant's
single request by at most one request of each other backlogged tenant (one scheduling round).

Higher tiers (priority 3) are always served before lower ones; a preempted request put back with
`push_front` is the next of its tier.

Cost: push/pop/peek O(log T) for T backlogged tenants in a tier; remove O(1) (lazy).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Item:
    item: Any
    tenant: str
    cost: float
    removed: bool = False


@dataclass
class _TenantQueue:
    weight: float
    items: deque[_Item] = field(default_factory=deque)
    live: int = 0
    tag: float = 0.0  # virtual start of the head request
    last_finish: float = 0.0  # virtual finish of the tenant's last served request
    epoch: int = 0  # bumped whenever the tenant's heap entry is replaced
    tie: int = 0  # its heap entry's tie-breaker (arrival order; negative for push_front)


class _Tier:
    def __init__(self) -> None:
        self.tenants: dict[str, _TenantQueue] = {}
        self.heap: list[tuple[float, int, str, int]] = []  # (tag, tie, tenant, epoch)
        self.virtual_time = 0.0
        self.live = 0
        self._ties = itertools.count()

    def schedule(self, queue: _TenantQueue, name: str, tag: float, first: bool = False) -> None:
        queue.tag = tag
        queue.epoch += 1
        queue.tie = -next(self._ties) if first else next(self._ties)
        heapq.heappush(self.heap, (tag, queue.tie, name, queue.epoch))

    def head(self) -> tuple[str, _TenantQueue] | None:
        """The tenant to serve next, skipping stale heap entries and removed items."""
        while self.heap:
            _, _, name, epoch = self.heap[0]
            queue = self.tenants.get(name)
            if queue is None or queue.epoch != epoch or queue.live == 0:
                heapq.heappop(self.heap)
                continue
            while queue.items[0].removed:
                queue.items.popleft()
            return name, queue
        return None


class FairQueue:
    """Waiting requests of all tenants.

    Args:
        weights: tenant name -> weight (default 1.0); `set_weight` changes it live.
    """

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self._weights = dict(weights or {})
        self._tiers: dict[int, _Tier] = {}
        self._entries: dict[int, tuple[_Item, int]] = {}  # id(item) -> (entry, priority)

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, item: object) -> bool:
        return id(item) in self._entries

    def __iter__(self) -> Iterator[Any]:
        """Every waiting item, highest tier first (not exactly service order)."""
        for priority in sorted(self._tiers, reverse=True):
            for queue in self._tiers[priority].tenants.values():
                yield from (e.item for e in queue.items if not e.removed)

    def set_weight(self, tenant: str, weight: float) -> None:
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        self._weights[tenant] = weight
        for tier in self._tiers.values():
            if tenant in tier.tenants:
                tier.tenants[tenant].weight = weight

    def push(self, item: Any, tenant: str, priority: int = 0, cost: float = 1.0) -> None:
        """Add a new request at the back of its tenant's queue; cost is what serving it charges
        (e.g. prompt tokens to prefill, or 1 to share by request count)."""
        self._add(item, tenant, priority, cost, front=False)

    def push_front(self, item: Any, tenant: str, priority: int = 0, cost: float = 1.0) -> None:
        """Put a preempted request back: it is the next one served in its tier."""
        self._add(item, tenant, priority, cost, front=True)

    def peek(self) -> Any:
        """The request `pop` would return; IndexError when empty."""
        _, _, queue = self._next()
        return queue.items[0].item

    def pop(self) -> Any:
        """Remove and return the next request; IndexError when empty."""
        tier, name, queue = self._next()
        return self._serve(tier, name, queue)

    def heads(self) -> Iterator[Any]:
        """The first waiting request of every tenant, in service order (highest tier first).

        For a scheduler that must skip a tenant whose head cannot run now (its KV shard is full)
        without holding up the others: it `take`s the first head that fits.
        """
        for priority in sorted(self._tiers, reverse=True):
            tier = self._tiers[priority]
            ordered = sorted((q.tag, q.tie, name) for name, q in tier.tenants.items() if q.live)
            for _, _, name in ordered:
                queue = tier.tenants[name]
                yield next(e.item for e in queue.items if not e.removed)

    def take(self, item: Any) -> None:
        """Serve `item`, the head of its tenant (from `heads`), as `pop` would serve it."""
        found = self._entries.get(id(item))
        if found is None:
            raise ValueError("item is not waiting")
        entry, priority = found
        tier = self._tiers[priority]
        queue = tier.tenants[entry.tenant]
        while queue.items[0].removed:
            queue.items.popleft()
        if queue.items[0] is not entry:
            raise ValueError("only the head of a tenant's queue can be taken")
        self._serve(tier, entry.tenant, queue)

    def _serve(self, tier: _Tier, name: str, queue: _TenantQueue) -> Any:
        entry = queue.items.popleft()
        queue.live -= 1
        tier.live -= 1
        del self._entries[id(entry.item)]
        tier.virtual_time = max(tier.virtual_time, queue.tag)  # `take` may serve a later tag first
        queue.last_finish = max(queue.last_finish, queue.tag + entry.cost / queue.weight)
        if queue.live:
            tier.schedule(queue, name, max(tier.virtual_time, queue.last_finish))
        else:
            queue.epoch += 1  # its heap entry is stale now
            queue.items.clear()
        return entry.item

    def remove(self, item: Any) -> bool:
        """Take a waiting request out (aborted); False if it is not waiting."""
        found = self._entries.pop(id(item), None)
        if found is None:
            return False
        entry, priority = found
        entry.removed = True
        tier = self._tiers[priority]
        queue = tier.tenants[entry.tenant]
        queue.live -= 1
        tier.live -= 1
        if queue.live == 0:
            queue.items.clear()
            queue.epoch += 1
        return True

    def _add(self, item: Any, tenant: str, priority: int, cost: float, *, front: bool) -> None:
        if id(item) in self._entries:
            raise ValueError("item is already waiting")
        if cost < 0:
            raise ValueError(f"cost must be >= 0, got {cost}")
        tier = self._tiers.setdefault(priority, _Tier())
        queue = tier.tenants.get(tenant)
        if queue is None:
            queue = tier.tenants[tenant] = _TenantQueue(weight=self._weights.get(tenant, 1.0))
        entry = _Item(item, tenant, cost)
        self._entries[id(item)] = (entry, priority)
        was_idle = queue.live == 0
        queue.live += 1
        tier.live += 1
        if front:
            queue.items.appendleft(entry)
            tier.schedule(queue, tenant, tier.virtual_time, first=True)
        else:
            queue.items.append(entry)
            if was_idle:
                tier.schedule(queue, tenant, max(tier.virtual_time, queue.last_finish))

    def _next(self) -> tuple[_Tier, str, _TenantQueue]:
        for priority in sorted(self._tiers, reverse=True):
            tier = self._tiers[priority]
            if tier.live:
                head = tier.head()
                if head is not None:
                    return tier, head[0], head[1]
        raise IndexError("the queue is empty")
