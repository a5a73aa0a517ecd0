"""The tenancy parts that sit beside the scheduler and the KV cache, in the engine's process.

`EngineTenancy` builds the shard-aware eviction policy, the fair waiting queue and the shared-pool
salt the engine is constructed with, and keeps them following live tenant-table updates. With the
engine in the server's process it shares the `Tenancy`'s registry (updates from the state store
reach it directly); with the engine in its own process (`sits serve`'s default) it is built there
from an `EngineTenancySpec`, the server sends each new table across (`apply_table`), and the engine
process sends back its eviction index and `EngineTenancyUsage` for the state store and /metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.state_store import ReplicaKVState
from sits.runtime.tenancy.tenant_sync import TenantRegistry
from sits.runtime.tenancy.tenants import SHARED_PREFIX_SALT, TenantTable

if TYPE_CHECKING:
    from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy
    from sits.runtime.tenancy.waiting_queue import FairWaitingQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineTenancySpec:
    """What the engine's process needs to build its tenancy parts (picklable).

    Attributes:
        config: the tenancy options (eviction alpha and TTL).
        table: the tenant table at start; later tables are sent as they arrive.
        engine_start: time.time() the eviction scores count from (seconds).
    """

    config: TenancyConfig
    table: TenantTable
    engine_start: float


@dataclass(frozen=True)
class EngineTenancyUsage:
    """The engine-side figures the server exports: KV blocks per tenant (`ShardUsage`), evictions (cumulative)."""

    blocks: Mapping[str, Any] = field(default_factory=dict)
    evictions_total: Mapping[str, int] = field(default_factory=dict)


class EngineTenancy:
    """Eviction policies and the fair queue of one engine, following the registry's tables."""

    def __init__(self, config: TenancyConfig, registry: TenantRegistry, engine_start: float) -> None:
        self.config = config
        self.registry = registry
        self.engine_start = engine_start
        self._policies: list = []
        self._queues: list = []

    @classmethod
    def from_spec(cls, spec: EngineTenancySpec) -> EngineTenancy:
        return cls(spec.config, TenantRegistry(spec.table), spec.engine_start)

    @property
    def table(self) -> TenantTable:
        return self.registry.table

    def apply_table(self, table: TenantTable) -> None:
        """A new tenant table (from the state store): shards, priorities and weights follow it."""
        self.registry.replace(table)

    def engine_hooks(self) -> dict:
        """Keyword arguments for `LLMEngine` / `AsyncEngine.from_config`: the shard-aware eviction
        policy (built once the cache is sized), the fair waiting queue, the shared-pool salt, the host
        KV tier's policy (built if the tier is on)."""
        return {"eviction_policy": self.eviction_policy, "waiting_queue": self.fair_queue(),
                "shared_cache_salt": SHARED_PREFIX_SALT, "host_eviction_policy": self.host_eviction_policy}

    def eviction_policy(self, num_blocks: int) -> TenantEvictionPolicy:
        """The engine's tenant-aware EvictionPolicy over `num_blocks`, following live table updates."""
        from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy  # imports the engine

        ttl = self.config.eviction_ttl_s or None
        policy = TenantEvictionPolicy(num_blocks, self.table, alpha=self.config.eviction_alpha, ttl_s=ttl,
                                      engine_start=self.engine_start)
        self.registry.subscribe(policy.apply_table)
        self._policies.append(policy)
        for name in self.table.names:
            if policy.shards.capacity(name) == 0:
                log.warning("tenant %s can hold no KV-cache block: its kvCacheShare is 0 and the other tenants' "
                            "shares take the whole cache; its requests will be refused", name)
        return policy

    def host_eviction_policy(self, num_blocks: int) -> Any:
        """The host KV tier's policy over `num_blocks` host blocks (hostKvCacheShare, the same score),
        following live table updates."""
        from sits.runtime.tenancy.host_kv_policy import host_tenant_eviction_policy  # imports the engine

        ttl = self.config.eviction_ttl_s or None
        policy = host_tenant_eviction_policy(num_blocks, self.table, alpha=self.config.eviction_alpha, ttl_s=ttl,
                                             engine_start=self.engine_start)
        self.registry.subscribe(policy.apply_table)
        return policy

    def fair_queue(self) -> FairWaitingQueue:
        """The scheduler's WaitingQueue, weighted by the tenants' `weight`, following live updates."""
        from sits.runtime.tenancy.waiting_queue import FairWaitingQueue  # imports the engine

        queue = FairWaitingQueue(self.table.weights())

        def reweigh(table: TenantTable) -> None:
            for name, weight in table.weights().items():
                queue.set_weight(name, weight)

        self.registry.subscribe(reweigh)
        self._queues.append(queue)
        return queue

    def eviction_index(self) -> dict:
        """This replica's eviction index (read it on the engine's thread, between steps)."""
        entries: dict = {}
        for policy in self._policies:
            entries.update(policy.eviction_index())
        return entries

    def kv_state(self) -> ReplicaKVState:
        """The cached prefix hashes and load a router reads (`sits.runtime.router`), read on the engine's thread."""
        hashes: set[bytes] = set()
        for policy in self._policies:
            hashes.update(policy.cached_block_hashes())
        kv_usage = max((policy.kv_usage() for policy in self._policies), default=0.0)
        return ReplicaKVState(frozenset(hashes), sum(len(queue) for queue in self._queues), kv_usage)

    def usage(self) -> EngineTenancyUsage:
        blocks: dict = {}
        evictions: dict[str, int] = {}
        for policy in self._policies:
            blocks.update(policy.usage())
            evictions.update(policy.evictions_total)
        return EngineTenancyUsage(blocks, evictions)
