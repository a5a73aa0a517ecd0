"""KV-cache shards: how many blocks each tenant holds, is guaranteed, and may still take.

A tenant's guarantee is `floor(kvCacheShare x total_blocks)` blocks. A tenant *holds* every block
whose content is its own: blocks of its running requests and its cached (unreferenced, still
hashed) blocks. Free blocks hold nothing.

The invariant kept here: the free blocks always cover every tenant's unfilled guarantee
(`free >= sum_u max(0, guaranteed[u] - held[u])`). So a tenant below its share can always reach it,
and a tenant at or beyond its share borrows only free blocks nobody else is guaranteed:

    headroom(t) = free - sum over u != t of max(0, guaranteed[u] - held[u])

Eviction follows from the same arithmetic: dropping a cached block of tenant `o` raises
`headroom(t)` by one if `o == t` or `o` is over its share, and by nothing otherwise (the freed
block is `o`'s guarantee). `eviction_helps(t, o)` is that test; the eviction policy only picks
blocks for which it holds, so no tenant ever evicts another tenant's guaranteed blocks.

The held counts are not kept here: they are the block pool's owner map's
(`sits.runtime.engine.block_owners.BlockOwners.held`), which the pool charges as it hands out and
empties blocks. A standalone accountant (no pool: a simulation, a test) keeps its own tally and
moves it with `allocate` / `release`. Pure arithmetic: no tensors, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from sits.runtime.engine.block_owners import TenantCounts


class ShardError(RuntimeError):
    """The KV-cache manager asked for something the shards cannot give (a bookkeeping bug)."""


@dataclass(frozen=True)
class ShardUsage:
    """One tenant's blocks at a moment (a metrics and state-store snapshot)."""

    held: int
    guaranteed: int
    borrowed: int


class ShardAccountant:
    """Per-tenant block counts against guaranteed shares.

    Args:
        total_blocks: blocks in the KV cache.
        shares: tenant name -> kvCacheShare (0..1, summing to at most 1). Tenants not listed
            (e.g. a shared-prefix pool) have no guarantee and can only borrow.
        held: the blocks each tenant holds: the pool's owner map's tally (`BlockOwners.held`),
            read only; None: a tally of this accountant's own, moved by `allocate` / `release`.
    """

    def __init__(self, total_blocks: int, shares: Mapping[str, float], held: TenantCounts | None = None) -> None:
        if total_blocks < 0:
            raise ValueError(f"total_blocks must be >= 0, got {total_blocks}")
        self.total_blocks = total_blocks
        self._own_tally = held is None
        self._held = TenantCounts() if held is None else held
        self._guaranteed: dict[str, int] = {}
        self.set_shares(shares)

    # -- configuration -------------------------------------------------------------------------

    def set_shares(self, shares: Mapping[str, float]) -> None:
        """Apply new shares (a live tenant-table update). Nothing is evicted here: a tenant that
        now holds more than its new guarantee simply counts as over its share."""
        total = sum(shares.values())
        if any(s < 0 for s in shares.values()) or total > 1.0 + 1e-9:
            raise ValueError(f"shares must be >= 0 and sum to at most 1, got {dict(shares)}")
        # If the free blocks cannot cover the new guarantees at once (a tenant was added to a full
        # cache), headrooms are 0 until evictions of over-share tenants free blocks: it self-heals.
        self._guaranteed = {name: math.floor(share * self.total_blocks + 1e-9) for name, share in shares.items()}
        self._held.set_floors(self._guaranteed)  # the tally keeps the unfilled guarantees' sum

    # -- queries -------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self._held.total

    @property
    def used_blocks(self) -> int:
        return self._held.total

    def guaranteed(self, tenant: str) -> int:
        return self._guaranteed.get(tenant, 0)

    def held(self, tenant: str) -> int:
        return self._held.get(tenant)

    def borrowed(self, tenant: str) -> int:
        """Blocks held beyond the guarantee."""
        return max(0, self.held(tenant) - self.guaranteed(tenant))

    def is_over_share(self, tenant: str) -> bool:
        return self.held(tenant) > self.guaranteed(tenant)

    def capacity(self, tenant: str) -> int:
        """The most blocks `tenant` can hold at once: its guarantee plus the blocks nobody is
        guaranteed (it can never borrow another tenant's unfilled guarantee)."""
        return self.guaranteed(tenant) + self.total_blocks - sum(self._guaranteed.values())

    def headroom(self, tenant: str) -> int:
        """Blocks `tenant` may take now without eviction (never negative)."""
        others_unfilled = self._held.shortfall - self._gap(tenant)
        return max(0, self.free_blocks - others_unfilled)

    def can_allocate(self, tenant: str, num_blocks: int) -> bool:
        return num_blocks <= self.headroom(tenant)

    def shortfall(self, tenant: str, num_blocks: int) -> int:
        """How many helpful evictions `tenant` needs before it can allocate num_blocks."""
        return max(0, num_blocks - self.headroom(tenant))

    def eviction_helps(self, requester: str, owner: str) -> bool:
        """Whether evicting one cached block of `owner` raises `requester`'s headroom."""
        return owner == requester or self.is_over_share(owner)

    def snapshot(self) -> dict[str, ShardUsage]:
        """Per-tenant counts; safe to call from a metrics thread (it copies before it reads)."""
        held, guaranteed = self._held.snapshot(), self._guaranteed
        names = set(guaranteed) | set(held)
        return {n: ShardUsage(held.get(n, 0), guaranteed.get(n, 0), max(0, held.get(n, 0) - guaranteed.get(n, 0)))
                for n in sorted(names)}

    # -- a standalone accountant's updates ------------------------------------------------------

    def allocate(self, tenant: str, num_blocks: int = 1) -> bool:
        """Charge num_blocks free blocks to tenant; False (and no change) if its headroom is short."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.headroom(tenant):
            return False
        self._move(tenant, num_blocks)
        return True

    def release(self, tenant: str, num_blocks: int = 1) -> None:
        """Return num_blocks of tenant's blocks to the free pool (freed uncached, or evicted)."""
        if num_blocks < 0 or num_blocks > self.held(tenant):
            raise ShardError(f"tenant {tenant!r} holds {self.held(tenant)} blocks, cannot release {num_blocks}")
        self._move(tenant, -num_blocks)

    def _gap(self, tenant: str) -> int:
        return max(0, self.guaranteed(tenant) - self.held(tenant))

    def _move(self, tenant: str, delta: int) -> None:
        if not self._own_tally:
            raise ShardError("this accountant reads a block pool's owner map: the pool charges it, not allocate/release")
        self._held.add(tenant, delta)
