"""The engine's EvictionPolicy, tenant-aware: KV shards plus score-ordered eviction.

Plugs into `sits.runtime.engine.block_pool.BlockPool` through its `EvictionPolicy` interface:
- `bind(pool)` hands the pool this policy's owner map (`BlockOwners`), which the pool charges: a
  tenant holds a block from the moment it is handed out until it is empty again, cached blocks
  included (a prefix hit charges nobody new: the block stays with the tenant that computed it).
  The shards (`ShardAccountant`) read their held counts from that map, nowhere else;
- `add` / `remove` index evictable blocks by score (`ScoreEvictionPolicy`), t being the block's
  `last_used_time`;
- `pop_victim(requester)` returns only blocks whose eviction raises the requester's headroom (its
  own, or those of a tenant above its share), so one tenant never evicts another's guaranteed blocks;
- `can_allocate(owner, n)` refuses when neither free blocks within the owner's headroom nor helpful
  evictions can supply n blocks (the scheduler then preempts or waits);
- `may_take_empty(owner)`, asked before each empty block, says no once the owner's headroom is
  spent: the free blocks left are other tenants' unfilled guarantees, so the pool evicts for it
  (its own cached blocks, or an over-share tenant's) or refuses;
- `preemption_helps(requester, victim)` lets the scheduler preempt only its own requests or those of
  tenants above their share, when nothing is left to evict.

For the router and metrics: `cached_block_hashes()` (the pool's findable prefix hashes), `kv_usage()`,
`usage()` and `eviction_index()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from sits.runtime.engine.block_owners import BlockOwners
from sits.runtime.engine.eviction import BlockOwner, EvictionPolicy, KVBlock
from sits.runtime.tenancy.eviction import DEFAULT_ALPHA, ScoreEvictionPolicy
from sits.runtime.tenancy.shards import ShardAccountant, ShardUsage
from sits.runtime.tenancy.state_store import EvictionIndexEntry
from sits.runtime.tenancy.tenants import TenantTable

if TYPE_CHECKING:
    from sits.runtime.engine.block_pool import BlockPool


class TenantEvictionPolicy(EvictionPolicy):
    """Shard accounting and score-based eviction behind the engine's EvictionPolicy interface.

    Args:
        num_blocks: blocks in the KV cache (the shards' total).
        table: tenants, for their shares and priorities; `apply_table` takes a live update.
        alpha, ttl_s, engine_start, clock: see ScoreEvictionPolicy.
        shares_of: each tenant's guaranteed fraction from a table (`TenantTable.shares`, the
            kvCacheShare; the host tier passes `TenantTable.host_shares`).
    """

    def __init__(self, num_blocks: int, table: TenantTable, *, alpha: float = DEFAULT_ALPHA,
                 ttl_s: float | None = None, engine_start: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 shares_of: Callable[[TenantTable], Mapping[str, float]] = TenantTable.shares) -> None:
        self._shares_of = shares_of
        self.owners = BlockOwners(num_blocks)
        self.shards = ShardAccountant(num_blocks, shares_of(table), self.owners.held)
        self.scores = ScoreEvictionPolicy(self.shards, table.priorities(), alpha=alpha, ttl_s=ttl_s,
                                          engine_start=engine_start, clock=clock)
        self._pool: BlockPool | None = None
        self._pending_table: TenantTable | None = None

    def apply_table(self, table: TenantTable) -> None:
        """A live tenant-table update: new shares and priorities apply to the next decision.

        Safe from any thread: the table is only handed over here and applied by the engine's
        own thread at its next allocation or eviction.
        """
        self._pending_table = table

    def _apply_pending_table(self) -> None:
        table, self._pending_table = self._pending_table, None
        if table is not None:
            self.shards.set_shares(self._shares_of(table))
            self.scores.set_priorities(table.priorities())

    # -- the engine's EvictionPolicy ------------------------------------------------------------

    def bind(self, pool: BlockPool) -> BlockOwners:
        """The pool this policy serves (one); it charges this policy's owner map."""
        if self._pool is not None:
            raise RuntimeError("this eviction policy already serves a block pool; build one per pool")
        if pool.num_blocks != self.owners.num_blocks:
            raise ValueError(f"the policy was built for {self.owners.num_blocks} blocks, the pool has {pool.num_blocks}")
        self._pool = pool
        return self.owners

    def add(self, block: KVBlock) -> None:
        tenant = self.owners.holder_of(block.block_id) or "default"
        last_used = block.last_used_time
        # a client-chosen request id carries no time: the block's last use is now
        self.scores.block_cached(block.block_id, tenant, time.time() if last_used is None else last_used)

    def remove(self, block: KVBlock) -> None:
        self.scores.block_taken(block.block_id)

    def pop_victim(self, requester: BlockOwner | None) -> KVBlock | None:
        self._apply_pending_table()
        victim = self.scores.select_victim(requester.tenant if requester is not None else None)
        if victim is None:
            return None
        assert self._pool is not None, "only the bound pool's blocks are ever indexed"
        return self._pool.blocks[victim.block_id]  # the pool empties it, which uncharges its holder

    def __len__(self) -> int:
        return len(self.scores)

    def can_allocate(self, owner: BlockOwner, num_blocks: int) -> bool:
        self._apply_pending_table()
        shortfall = self.shards.shortfall(owner.tenant, num_blocks)
        return shortfall == 0 or shortfall <= self.scores.evictable_for(owner.tenant)

    def max_blocks(self, tenant: str) -> int | None:
        return self.shards.capacity(tenant)

    def preemption_helps(self, requester: BlockOwner, victim: BlockOwner) -> bool:
        self._apply_pending_table()
        return self.shards.eviction_helps(requester.tenant, victim.tenant)

    # -- for the pool and for metrics -----------------------------------------------------------

    def may_take_empty(self, owner: BlockOwner) -> bool:
        """Whether `owner` may take an empty block now without eating another tenant's unfilled
        guarantee; if not, it must evict (`pop_victim`) or wait."""
        return self.shards.headroom(owner.tenant) > 0

    def usage(self) -> dict[str, ShardUsage]:
        """Blocks held / guaranteed / borrowed per tenant (`sits_kv_blocks_used{tenant}`)."""
        return self.shards.snapshot()

    @property
    def evictions_total(self) -> dict[str, int]:
        return dict(self.scores.evictions_total)

    def cached_block_hashes(self) -> frozenset[bytes]:
        """Prefix hashes of the blocks a prompt can hit now (the pool's hash index); at most
        `num_blocks` of them. Call it on the engine's thread."""
        return self._pool.cached_hashes() if self._pool is not None else frozenset()

    def kv_usage(self) -> float:
        """Fraction of the cache's blocks referenced by running requests (cached-but-idle blocks
        are free to take), 0..1."""
        return self._pool.usage if self._pool is not None else 0.0

    def eviction_index(self) -> dict[str, EvictionIndexEntry]:
        """This replica's entry for `StateStore.publish_eviction_index` (call it on the engine's
        thread: it reads the index)."""
        scores = self.scores.snapshot()
        entries = {}
        for tenant, usage in self.usage().items():
            cached = scores.get(tenant, {})
            entries[tenant] = EvictionIndexEntry(
                cached_blocks=int(cached.get("cached_blocks", 0)), held_blocks=usage.held,
                guaranteed_blocks=usage.guaranteed, lowest_score=float(cached.get("lowest_score", 0.0)),
                evictions_total=self.evictions_total.get(tenant, 0))
        return entries
