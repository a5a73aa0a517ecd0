"""The engine's EvictionPolicy, tenant-aware: KV shards plus score-ordered eviction.

Plugs into `sits.runtime.engine.block_pool.BlockPool` through its `EvictionPolicy` hooks:
- `on_allocate` / `on_empty` keep `ShardAccountant` in step with the pool: a tenant holds a block
  from the moment it is handed out until it is empty again, cached blocks included (a prefix hit,
  `on_touch`, charges nobody new: the block stays with the tenant that computed it);
- `add` / `remove` index evictable blocks by score (`ScoreEvictionPolicy`);
- `pop_victim(requester)` returns only blocks whose eviction raises the requester's headroom (its
  own, or those of a tenant above its share), so one tenant never evicts another's guaranteed blocks;
- `can_allocate(owner, n)` refuses when neither free blocks within the owner's headroom nor helpful
  evictions can supply n blocks (the scheduler then preempts or waits);
- `preemption_helps(requester, victim)` lets the scheduler preempt only its own requests or those of
  tenants above their share, lowest priority first, when nothing is left to evict.

- `may_take_empty(owner)`, asked before each empty block, says no once the owner's headroom is
  spent: the free blocks left are other tenants' unfilled guarantees, so the pool evicts for it
  (its own cached blocks, or an over-share tenant's) or refuses.
- `cached_block_hashes()` names the prefix hashes this replica can serve from its cache (blocks
  seen with a hash when released or hit, until they are emptied), for the router's KV index.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from sits.runtime.engine.eviction import BlockOwner, EvictionPolicy, KVBlock
from sits.runtime.tenancy.eviction import DEFAULT_ALPHA, ScoreEvictionPolicy
from sits.runtime.tenancy.shards import ShardAccountant, ShardUsage
from sits.runtime.tenancy.state_store import EvictionIndexEntry
from sits.runtime.tenancy.tenants import TenantTable


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
        self.shards = ShardAccountant(num_blocks, shares_of(table))
        self.scores = ScoreEvictionPolicy(self.shards, table.priorities(), alpha=alpha, ttl_s=ttl_s,
                                          engine_start=engine_start, clock=clock)
        self._holder: dict[int, str] = {}  # block id -> tenant holding it (mirrors the pool)
        self._evictable: dict[int, KVBlock] = {}
        self._hash_of: dict[int, bytes] = {}  # block id -> prefix hash, while the block is findable
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

    def add(self, block: KVBlock) -> None:
        owner = block.last_owner
        tenant = self._holder.get(block.block_id) or (owner.tenant if owner else "default")
        self._evictable[block.block_id] = block
        self._note_hash(block)
        self.scores.block_cached(block.block_id, tenant, owner.request_id if owner else "")

    def remove(self, block: KVBlock) -> None:
        self._evictable.pop(block.block_id, None)
        self.scores.block_taken(block.block_id)

    def pop_victim(self, requester: BlockOwner | None) -> KVBlock | None:
        self._apply_pending_table()
        victim = self.scores.select_victim(requester.tenant if requester is not None else None)
        if victim is None:
            return None
        return self._evictable.pop(victim.block_id)  # the pool empties it: on_empty follows

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

    def on_allocate(self, block: KVBlock, owner: BlockOwner) -> None:
        self._uncharge(block.block_id)  # an evicted block still charged to its last holder
        self._holder[block.block_id] = owner.tenant
        self.shards.charge(owner.tenant)

    def on_touch(self, block: KVBlock, owner: BlockOwner) -> None:
        self._note_hash(block)

    def on_empty(self, block: KVBlock, holder: str) -> None:
        self._hash_of.pop(block.block_id, None)
        self._uncharge(block.block_id)

    def on_release(self, block: KVBlock) -> None:
        if block.ref_count == 0 and block.block_hash is None:  # about to become empty
            self._uncharge(block.block_id)

    def _note_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self._hash_of[block.block_id] = block.block_hash

    def _uncharge(self, block_id: int) -> None:
        holder = self._holder.pop(block_id, None)
        if holder is not None:
            self.shards.release(holder)

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
        """Prefix hashes of the blocks a prompt can hit now (released or hit since they were
        cached, not yet emptied); at most `num_blocks` of them. Call it on the engine's thread."""
        return frozenset(self._hash_of.values())

    def kv_usage(self) -> float:
        """Fraction of the cache's blocks referenced by running requests (cached-but-idle blocks
        are free to take), 0..1."""
        total = self.shards.total_blocks
        in_use = sum(u.held for u in self.usage().values()) - len(self._evictable)
        return min(max(in_use / total, 0.0), 1.0) if total else 0.0

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
