"""The host KV tier's tenant-aware eviction: the GPU policy's score and shards, over hostKvCacheShare.

`sits.runtime.engine.host_tier.HostKVTier` keeps evicted GPU blocks in a second `BlockPool`; with
tenants, that pool's EvictionPolicy is this one. It is the GPU cache's `TenantEvictionPolicy`
(victims by `t x (1 + alpha x priority)`, a tenant never evicting another's guaranteed blocks,
borrowing of blocks nobody is guaranteed) with each tenant's guarantee taken from its
`hostKvCacheShare` instead of its `kvCacheShare`. An offload the policy refuses (the tenant is at
its share and nothing of its own or of an over-share tenant is evictable) drops the block.
Its shards read the host pool's own owner map; a host block is charged to the tenant that held the
GPU block and keeps that block's last use (t), so a block's score does not change as it moves down.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sits.runtime.tenancy.eviction import DEFAULT_ALPHA
from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy
from sits.runtime.tenancy.tenants import TenantTable


def host_tenant_eviction_policy(num_blocks: int, table: TenantTable, *, alpha: float = DEFAULT_ALPHA,
                                ttl_s: float | None = None, engine_start: float | None = None,
                                clock: Callable[[], float] = time.monotonic) -> TenantEvictionPolicy:
    """The host tier's policy over `num_blocks` host blocks: guarantees from `hostKvCacheShare`,
    the same score and borrowing rules as the GPU cache; `apply_table` takes live updates."""
    return TenantEvictionPolicy(num_blocks, table, alpha=alpha, ttl_s=ttl_s, engine_start=engine_start,
                                clock=clock, shares_of=TenantTable.host_shares)
