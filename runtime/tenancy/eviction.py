"""Which cached KV block to drop when a tenant needs blocks: score-based, shard-aware eviction.

A block enters the index when its last request lets go of it (its reference count reaches 0 and
it keeps its prefix hash), and leaves it when a request hits it again or it is evicted.

    score(block) = t x (1 + alpha x priority)

`t` is the time of the block's last use, in seconds since the engine started: when the request
that last referenced the block was issued (`KVBlock.last_used_time`, the time its request id
carries); `priority` (0-3) is its tenant's. Lower scores go first. Order of victims for a
requesting tenant:

1. blocks idle (unreferenced) longer than the TTL, oldest first;
2. blocks of tenants over their KV share, lowest score first;
3. the requester's own blocks, lowest score first.

Only blocks whose eviction raises the requester's headroom are candidates (its own, and those of
tenants over their share: `ShardAccountant.eviction_helps`), so a tenant never evicts another
tenant's guaranteed blocks. When nothing is left, the scheduler preempts a running request whose
blocks would help the same way (`TenantEvictionPolicy.preemption_helps`), in its policy's order.

Cost: `block_cached` O(log n), `block_taken` O(1) (lazy invalidation: stale heap entries are
skipped and compacted away), `select_victim` O(T + log n) for T tenants holding cached blocks.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sits.runtime.tenancy.shards import ShardAccountant

DEFAULT_ALPHA = 0.2


@dataclass(frozen=True)
class EvictedBlock:
    """A block the policy chose; the caller frees it (the pool's owner map then uncharges its tenant)."""

    block_id: int
    tenant: str
    score: float
    expired: bool


@dataclass
class _Entry:
    tenant: str
    t: float  # seconds since engine start of the last use
    released: float  # monotonic seconds when it became unreferenced
    generation: int


class _TenantBlocks:
    """One tenant's evictable blocks: a min-heap by t and a FIFO by release time, both lazy."""

    def __init__(self) -> None:
        self.live: dict[int, _Entry] = {}
        self.by_t: list[tuple[float, int, int]] = []  # (t, generation, block_id)
        self.by_release: deque[tuple[float, int, int]] = deque()  # (released, generation, block_id)

    def add(self, block_id: int, entry: _Entry) -> None:
        self.live[block_id] = entry
        heapq.heappush(self.by_t, (entry.t, entry.generation, block_id))
        self.by_release.append((entry.released, entry.generation, block_id))

    def _is_live(self, generation: int, block_id: int) -> bool:
        entry = self.live.get(block_id)
        return entry is not None and entry.generation == generation

    def lowest_t(self) -> tuple[int, _Entry] | None:
        while self.by_t and not self._is_live(self.by_t[0][1], self.by_t[0][2]):
            heapq.heappop(self.by_t)
        if not self.by_t:
            return None
        block_id = self.by_t[0][2]
        return block_id, self.live[block_id]

    def oldest_release(self) -> tuple[int, _Entry] | None:
        while self.by_release and not self._is_live(self.by_release[0][1], self.by_release[0][2]):
            self.by_release.popleft()
        if not self.by_release:
            return None
        block_id = self.by_release[0][2]
        return block_id, self.live[block_id]

    def compact_if_stale(self) -> None:
        """Rebuild both orders once stale entries outnumber live ones (keeps memory O(live))."""
        if len(self.by_t) + len(self.by_release) <= 4 * len(self.live) + 64:
            return
        self.by_t = [(e.t, e.generation, b) for b, e in self.live.items()]
        heapq.heapify(self.by_t)
        self.by_release = deque(sorted((e.released, e.generation, b) for b, e in self.live.items()))


class ScoreEvictionPolicy:
    """The default policy (see the module docstring).

    Args:
        shards: the tenants' shard accounts; read to know who is over share.
        priorities: tenant name -> priority 0-3 (unknown tenants count as 0); `set_priorities`
            replaces it on a live tenant-table update without touching the index.
        alpha: weight of priority in the score.
        ttl_s: blocks unreferenced longer than this go first; None disables the TTL.
        engine_start: Unix seconds (time.time()) when the engine started: the origin of t.
        clock: monotonic seconds, for the TTL.
    """

    def __init__(self, shards: ShardAccountant, priorities: Mapping[str, int] | None = None, *,
                 alpha: float = DEFAULT_ALPHA, ttl_s: float | None = None, engine_start: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._shards = shards
        self._priorities = dict(priorities or {})
        self.alpha = alpha
        self.ttl_s = ttl_s
        self.engine_start = time.time() if engine_start is None else engine_start
        self._clock = clock
        self._tenants: dict[str, _TenantBlocks] = {}
        self._indexed: dict[int, str] = {}  # evictable block id -> the tenant whose index holds it
        self._generations = itertools.count()
        self.evictions_total: dict[str, int] = defaultdict(int)

    def __len__(self) -> int:
        return len(self._indexed)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._indexed

    def set_priorities(self, priorities: Mapping[str, int]) -> None:
        self._priorities = dict(priorities)

    def score(self, tenant: str, t: float) -> float:
        return t * (1.0 + self.alpha * self._priorities.get(tenant, 0))

    def block_score(self, block_id: int) -> float:
        tenant = self._indexed[block_id]
        return self.score(tenant, self._tenants[tenant].live[block_id].t)

    def cached_blocks(self, tenant: str) -> int:
        blocks = self._tenants.get(tenant)
        return len(blocks.live) if blocks else 0

    def evictable_for(self, requester: str) -> int:
        """How many evictions could raise `requester`'s headroom now: all its own cached blocks,
        and each over-share tenant's cached blocks down to its guarantee. O(T)."""
        total = 0
        for tenant, blocks in self._tenants.items():
            if tenant == requester:
                total += len(blocks.live)
            else:
                total += min(len(blocks.live), self._shards.borrowed(tenant))
        return total

    # -- index updates --------------------------------------------------------------------------

    def block_cached(self, block_id: int, tenant: str, last_used_time: float) -> None:
        """The block's last reference went away; it stays cached and becomes evictable.

        Args:
            block_id: the block.
            tenant: the tenant holding it.
            last_used_time: Unix seconds of its last use (`KVBlock.last_used_time`); t is this
                minus `engine_start`, 0 for a use before the engine started.
        """
        self.block_taken(block_id)
        entry = _Entry(tenant, max(0.0, last_used_time - self.engine_start), self._clock(), next(self._generations))
        self._tenants.setdefault(tenant, _TenantBlocks()).add(block_id, entry)
        self._indexed[block_id] = tenant

    def block_taken(self, block_id: int) -> None:
        """The block is referenced again (a prefix hit) or gone: no longer evictable."""
        tenant = self._indexed.pop(block_id, None)
        if tenant is None:
            return
        blocks = self._tenants[tenant]
        del blocks.live[block_id]
        if blocks.live:
            blocks.compact_if_stale()
        else:
            del self._tenants[tenant]

    # -- choosing victims -----------------------------------------------------------------------

    def select_victim(self, requester: str | None) -> EvictedBlock | None:
        """Remove and return the next block to evict so `requester` can allocate (see the module
        docstring), or None when no cached block would help it. With requester None (dropping
        the whole cache) every block is a candidate, lowest score first."""
        expired: tuple[float, int, str] | None = None  # (released, block_id, tenant)
        over_share: tuple[float, int, str] | None = None  # (score, block_id, tenant)
        own: tuple[float, int, str] | None = None
        deadline = None if self.ttl_s is None else self._clock() - self.ttl_s
        for tenant, blocks in self._tenants.items():
            if requester is not None and not self._shards.eviction_helps(requester, tenant):
                continue
            if deadline is not None:
                oldest = blocks.oldest_release()
                if oldest is not None and oldest[1].released < deadline and (
                        expired is None or oldest[1].released < expired[0]):
                    expired = (oldest[1].released, oldest[0], tenant)
            lowest = blocks.lowest_t()
            if lowest is None:
                continue
            candidate = (self.score(tenant, lowest[1].t), lowest[0], tenant)
            if requester is None or self._shards.is_over_share(tenant):
                over_share = min(over_share, candidate) if over_share else candidate
            else:
                own = candidate  # only the requester itself gets here
        if expired is not None:
            return self._evict(expired[1], expired[2], expired=True)
        chosen = over_share or own
        return None if chosen is None else self._evict(chosen[1], chosen[2], expired=False)

    def pop_expired(self) -> list[EvictedBlock]:
        """Remove and return every block past the TTL, of any tenant (a periodic sweep)."""
        if self.ttl_s is None:
            return []
        deadline = self._clock() - self.ttl_s
        evicted = []
        for tenant in list(self._tenants):
            while tenant in self._tenants:
                oldest = self._tenants[tenant].oldest_release()
                if oldest is None or oldest[1].released >= deadline:
                    break
                evicted.append(self._evict(oldest[0], tenant, expired=True))
        return evicted

    def _evict(self, block_id: int, tenant: str, *, expired: bool) -> EvictedBlock:
        victim = EvictedBlock(block_id, tenant, self.block_score(block_id), expired)
        self.block_taken(block_id)
        self.evictions_total[tenant] += 1
        return victim

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per tenant: cached (evictable) blocks and the lowest score among them (the eviction index)."""
        result = {}
        for tenant, blocks in self._tenants.items():
            lowest = blocks.lowest_t()
            result[tenant] = {"cached_blocks": len(blocks.live),
                              "lowest_score": self.score(tenant, lowest[1].t) if lowest else 0.0,
                              "evictions_total": self.evictions_total.get(tenant, 0)}
        return result
