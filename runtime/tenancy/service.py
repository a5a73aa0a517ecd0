"""Everything tenancy for one server process, built from `TenancyConfig` and wired together.

    tenancy = Tenancy.from_config(config)      # reads --tenants, opens --state-store (no I/O yet)
    engine = AsyncEngine.from_config(engine_config, **tenancy.engine_hooks())   # policy, queue, salt
    engine.add_periodic(tenancy.publish_eviction_index, 1.0)       # on the engine's thread
    app = build_app(engine, server_config, tenancy=tenancy)         # resolver, usage, metrics, start/close

What `build_app` does with it, piece by piece:

    await tenancy.start()                      # connects, syncs the tenant table
    tenant = tenancy.authenticate(headers)     # AuthenticationError -> 401
    decision = await tenancy.limiter.check(tenant, prompt_tokens)   # refused -> 429
    registry.register(tenancy.collector(model, track))              # Prometheus
    tenancy.observe_prompt(name, n); tenancy.observe_usage(name, prompt, completion)   # no I/O
    await tenancy.close()

With the engine in its own process (`sits serve`'s default) the engine-side parts are built there
from `tenancy.engine_spec()` (`sits.runtime.tenancy.engine_side`); `use_remote_engine` forwards each
new tenant table to it and reads back its figures.

Live tenant-table updates reach the authenticator, the shards, the eviction priorities and the
queue weights through the registry's listeners; each tenant's `models` allow-list is read from the
tenant authenticated for each request, so a new list applies to the next request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping

from sits.runtime.tenancy.auth import Authenticator, AuthMode
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.engine_side import EngineTenancy, EngineTenancySpec, EngineTenancyUsage
from sits.runtime.tenancy.limits import RateLimiter
from sits.runtime.tenancy.metrics import TenancyCollector, TenancySnapshot
from sits.runtime.tenancy.state_store import StateStore, open_state_store
from sits.runtime.tenancy.tenant_sync import TenantRegistry, TenantSync
from sits.runtime.tenancy.tenants import Tenant, TenantTable, load_tenants_file

log = logging.getLogger(__name__)


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
        self.engine_side = EngineTenancy(config, self.registry, self.engine_start)
        # Where the engine-side figures come from: this process's policies, or the engine process's.
        self._engine_usage: Callable[[], EngineTenancyUsage] = self.engine_side.usage

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

    def warn_unserved_models(self, served: Collection[str]) -> None:
        """Warn about each tenant whose `models` names an id outside `served` (the base model's name
        and the adapters'), now and after every live table update. Not an error: an operator may
        write the table before the adapters change; until then those requests get the 404 of an
        unknown model."""
        served = frozenset(served)

        def warn(table: TenantTable) -> None:
            for name, model_ids in table.unserved_models(served).items():
                log.warning("tenant %s lists model(s) %s, which this server does not serve (serving: %s)",
                            name, ", ".join(model_ids), ", ".join(sorted(served)))

        warn(self.table)
        self.registry.subscribe(warn)

    def cache_salt(self, tenant: Tenant, shared: bool = False) -> str:
        """`Sequence.cache_salt` for a request of this tenant (prompts marked shared use the pool's)."""
        return self.table.prefix_salt(tenant, shared)

    def observe_prompt(self, tenant_name: str, prompt_tokens: int) -> None:
        """A request's prompt was tokenized: its tokens count in the tenant's TPM window. No I/O."""
        tenant = self.table.get(tenant_name)
        if tenant is not None:
            self.limiter.record_tokens(tenant, prompt_tokens)

    def observe_usage(self, tenant_name: str, prompt_tokens: int, completion_tokens: int) -> None:
        """An engine request ended (the server's usage observer): usage counters, and its
        generated tokens in the TPM window. No I/O."""
        tenant = self.table.get(tenant_name)
        if tenant is not None:
            self.record_usage(tenant, prompt_tokens, completion_tokens)

    def record_usage(self, tenant: Tenant, prompt_tokens: int, completion_tokens: int) -> None:
        """A finished request: usage counters, and its generated tokens in the TPM window. No I/O."""
        self.store.add_usage(tenant.name, requests=1, prompt_tokens=prompt_tokens,
                             completion_tokens=completion_tokens)
        self.limiter.record_tokens(tenant, completion_tokens)

    def eviction_policy(self, num_blocks: int):
        """The in-process engine's tenant-aware EvictionPolicy (`EngineTenancy.eviction_policy`)."""
        return self.engine_side.eviction_policy(num_blocks)

    def host_eviction_policy(self, num_blocks: int):
        """The in-process engine's host KV tier policy (`EngineTenancy.host_eviction_policy`)."""
        return self.engine_side.host_eviction_policy(num_blocks)

    def fair_queue(self):
        """The in-process engine's fair WaitingQueue (`EngineTenancy.fair_queue`)."""
        return self.engine_side.fair_queue()

    def engine_hooks(self) -> dict:
        """Keyword arguments for an in-process `LLMEngine` / `AsyncEngine.from_config`: the
        shard-aware eviction policy, the fair waiting queue, the shared-pool salt."""
        return self.engine_side.engine_hooks()

    def publish_eviction_index(self) -> None:
        """Hand this replica's eviction index and KV state (cached prefix hashes and load, for a router) to
        the store (written in its next batch; no I/O). Call it on the engine's thread
        (`AsyncEngine.add_periodic`): it reads the index."""
        self.store.publish_eviction_index(self.engine_side.eviction_index())
        self.store.publish_kv_state(self.engine_side.kv_state())

    def engine_spec(self) -> EngineTenancySpec:
        """What an engine process needs to build its own `EngineTenancy`."""
        return EngineTenancySpec(self.config, self.table, self.engine_start)

    def use_remote_engine(self, usage: Callable[[], EngineTenancyUsage],
                          send_table: Callable[[TenantTable], None]) -> None:
        """The engine runs in another process: its figures come from `usage` (the latest it sent),
        and every new tenant table goes to `send_table`, which forwards it there."""
        self._engine_usage = usage
        self.registry.subscribe(send_table)

    def snapshot(self) -> TenancySnapshot:
        usage = self._engine_usage()
        return TenancySnapshot(blocks=dict(usage.blocks), evictions_total=dict(usage.evictions_total),
                               rate_limited_total=dict(self.limiter.rate_limited_total),
                               state_store_up=self.store.up, tenants=tuple(self.table.names),
                               replica_id=self.store.replica_id)

    def collector(self, model: str, track: str) -> TenancyCollector:
        return TenancyCollector(self.snapshot, model, track)
