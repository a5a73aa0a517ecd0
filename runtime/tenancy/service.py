"""Everything tenancy for one server process, built from `TenancyConfig` and wired together.

    tenancy = Tenancy.from_config(config)      # reads --tenants, opens --state-store (no I/O yet)
    await tenancy.start()                      # connects, syncs the tenant table
    tenant = tenancy.authenticate(headers)     # AuthenticationError -> 401
    decision = await tenancy.limiter.check(tenant, prompt_tokens)   # refused -> 429
    policy = tenancy.eviction_policy(num_blocks)                    # the engine's EvictionPolicy
    queue = tenancy.fair_queue()                                     # the scheduler's waiting queue
    registry.register(tenancy.collector(model, track))              # Prometheus
    await tenancy.close()

Live tenant-table updates reach the authenticator, the shards, the eviction priorities and the
queue weights through the registry's listeners.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from sits.runtime.tenancy.auth import Authenticator, AuthMode
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.limits import RateLimiter
from sits.runtime.tenancy.metrics import TenancyCollector, TenancySnapshot
from sits.runtime.tenancy.state_store import StateStore, open_state_store
from sits.runtime.tenancy.tenant_sync import TenantRegistry, TenantSync
from sits.runtime.tenancy.tenants import Tenant, TenantTable, load_tenants_file


class Tenancy:
    """The tenancy parts of one process (see the module docstring)."""

    def __init__(self, config: TenancyConfig, seed: TenantTable, store: StateStore) -> None:
        config.validate()
        self.config = config
        self.store = store
        self.registry = TenantRegistry(seed)
        self._seed = seed
        gateway = config.trusted_gateway_header
        mode = AuthMode.TRUSTED_GATEWAY if gateway else (AuthMode.API_KEY if seed.requires_auth else AuthMode.OPEN)
        self.authenticator = Authenticator(lambda: self.registry.table, mode, gateway_header=gateway or "x-sits-tenant")
        self.limiter = RateLimiter(store)
        # Without --tenants there is nothing to sync: the server stays open whatever the store holds.
        self.sync = TenantSync(self.registry, store, poll_interval_s=config.tenant_poll_interval_s,
                               require_keys=gateway is None) if seed.requires_auth else None
        self.engine_start = time.time()
        self._policies: list = []

    @classmethod
    def from_config(cls, config: TenancyConfig) -> Tenancy:
        """Read the tenants file and open the state store; raises TenantConfigError / ConfigError."""
        config.validate()
        gateway = config.trusted_gateway_header is not None
        seed = (load_tenants_file(config.tenants_file, require_keys=not gateway) if config.tenants_file
                else TenantTable.open_access())
        store = open_state_store(config.state_store, deployment=config.deployment,
                                 flush_interval_s=config.state_flush_interval_s)
        return cls(config, seed, store)

    async def start(self) -> None:
        await self.store.start()
        if self.sync is not None:
            await self.sync.start(self._seed)

    async def close(self) -> None:
        if self.sync is not None:
            await self.sync.close()
        await self.store.close()

    @property
    def table(self) -> TenantTable:
        return self.registry.table

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        return self.authenticator.authenticate(headers)

    def cache_salt(self, tenant: Tenant, shared: bool = False) -> str:
        """`Sequence.cache_salt` for a request of this tenant (prompts marked shared use the pool's)."""
        return self.table.prefix_salt(tenant, shared)

    def record_usage(self, tenant: Tenant, prompt_tokens: int, completion_tokens: int) -> None:
        """A finished request: usage counters, and its generated tokens in the TPM window. No I/O."""
        self.store.add_usage(tenant.name, requests=1, prompt_tokens=prompt_tokens,
                             completion_tokens=completion_tokens)
        self.limiter.record_tokens(tenant, completion_tokens)

    def eviction_policy(self, num_blocks: int):
        """The engine's tenant-aware EvictionPolicy over `num_blocks`, following live table updates."""
        from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy  # imports the engine

        ttl = self.config.eviction_ttl_s or None
        policy = TenantEvictionPolicy(num_blocks, self.table, alpha=self.config.eviction_alpha, ttl_s=ttl,
                                      engine_start=self.engine_start)
        self.registry.subscribe(policy.apply_table)
        self._policies.append(policy)
        return policy

    def fair_queue(self):
        """The scheduler's WaitingQueue, weighted by the tenants' `weight`, following live updates."""
        from sits.runtime.tenancy.waiting_queue import FairWaitingQueue  # imports the engine

        queue = FairWaitingQueue(self.table.weights())

        def reweigh(table: TenantTable) -> None:
            for name, weight in table.weights().items():
                queue.set_weight(name, weight)

        self.registry.subscribe(reweigh)
        return queue

    def snapshot(self) -> TenancySnapshot:
        blocks: dict = {}
        evictions: dict[str, int] = {}
        for policy in self._policies:
            blocks.update(policy.usage())
            evictions.update(policy.evictions_total)
        return TenancySnapshot(blocks=blocks, evictions_total=evictions,
                               rate_limited_total=dict(self.limiter.rate_limited_total),
                               state_store_up=self.store.up, tenants=tuple(self.table.names))

    def collector(self, model: str, track: str) -> TenancyCollector:
        return TenancyCollector(self.snapshot, model, track)
