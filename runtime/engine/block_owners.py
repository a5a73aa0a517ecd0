"""Which tenant holds which KV blocks: the one owner map, charged by the block pool, read by the rest.

Two facts per block, both kept here and nowhere else:
  - its *holder*: the tenant it was handed to (`charge`), from allocation until the block is empty
    again (`uncharge`: released without a hash, or its hash dropped by eviction or a cache reset).
    Cached blocks count: their content is the holder's. The tenancy layer's shards and eviction
    read the holders (`sits.runtime.tenancy.shards.ShardAccountant`);
  - its *user*: the tenant whose reference took it out of the free set (`use`), while any reference
    remains (`unuse`). This is what `kv_blocks_used_by_tenant` reports.

Each fact has a per-tenant tally (`TenantCounts`) updated in the same call, so reading a tenant's
count is O(1). Pure bookkeeping: no tensors, no policy.
"""

from __future__ import annotations

from collections.abc import Mapping


class TenantCounts:
    """Blocks per tenant and their sum: one tally of the owner map (or a standalone
    `ShardAccountant`'s own).

    A reader may set per-tenant floors (`set_floors`: the shards' guarantees); the tally then keeps
    `shortfall`, the blocks all tenants together lack to reach their floors, in step with every
    `add`, so that the reader's question costs O(1) however many tenants there are.
    """

    def __init__(self) -> None:
        self._by_tenant: dict[str, int] = {}
        self.total = 0
        self._floors: dict[str, int] = {}
        self.shortfall = 0  # sum over tenants of max(0, floor - count)

    def get(self, tenant: str) -> int:
        return self._by_tenant.get(tenant, 0)

    def add(self, tenant: str, delta: int) -> None:
        """Move `tenant`'s count by `delta` blocks (tenants at 0 are dropped)."""
        before = self._by_tenant.get(tenant, 0)
        count = before + delta
        if count:
            self._by_tenant[tenant] = count
        else:
            self._by_tenant.pop(tenant, None)
        self.total += delta
        floor = self._floors.get(tenant)
        if floor is not None:
            self.shortfall += max(0, floor - count) - max(0, floor - before)

    def set_floors(self, floors: Mapping[str, int]) -> None:
        """The counts each tenant should reach (tenants not named have none); resets `shortfall`."""
        self._floors = dict(floors)
        self.shortfall = sum(max(0, floor - self.get(tenant)) for tenant, floor in self._floors.items())

    def snapshot(self) -> dict[str, int]:
        """A copy, tenants with blocks only (safe from a metrics thread: the copy is one C call)."""
        return dict(self._by_tenant)


class _PerBlock:
    """One fact per block (a tenant, or None) and its per-tenant tally, changed together."""

    def __init__(self, num_blocks: int) -> None:
        self.tenant_of: list[str | None] = [None] * num_blocks
        self.counts = TenantCounts()

    def set(self, block_id: int, tenant: str) -> None:
        self.tenant_of[block_id] = tenant
        self.counts.add(tenant, 1)

    def clear(self, block_id: int) -> None:
        tenant = self.tenant_of[block_id]
        if tenant is not None:
            self.tenant_of[block_id] = None
            self.counts.add(tenant, -1)


class BlockOwners:
    """The holder and the user of each of `num_blocks` blocks, with per-tenant tallies.

    Args:
        num_blocks: blocks in the cache (block ids are 0 .. num_blocks - 1).

    Attributes:
        held: non-empty blocks per holder (read it; the pool charges it).
        used: referenced blocks per user.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._holders = _PerBlock(num_blocks)
        self._users = _PerBlock(num_blocks)
        self.held = self._holders.counts
        self.used = self._users.counts

    def charge(self, block_id: int, tenant: str) -> None:
        """`tenant` holds the block from now on (the pool handed an empty block to it)."""
        holder = self._holders.tenant_of[block_id]
        if holder is not None:
            raise RuntimeError(f"block {block_id} is already held by {holder!r}")
        self._holders.set(block_id, tenant)

    def uncharge(self, block_id: int) -> None:
        """The block is empty again: nobody holds it."""
        self._holders.clear(block_id)

    def use(self, block_id: int, tenant: str) -> None:
        """A reference by `tenant` took the block out of the free set (empty or evictable)."""
        self._users.set(block_id, tenant)

    def unuse(self, block_id: int) -> None:
        """The block's last reference went away."""
        self._users.clear(block_id)

    def holder_of(self, block_id: int) -> str | None:
        """The tenant holding a non-empty block (the one it was allocated to), None for an empty one."""
        return self._holders.tenant_of[block_id]
