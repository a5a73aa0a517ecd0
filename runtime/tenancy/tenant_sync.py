"""The live tenant table: seeded from the tenants file, kept in step with the state store.

An operator updates tenants by writing a new table to the store (`StateStore.put_tenant_table`,
digests only); every replica polls the table's version and swaps the new table in, then tells its
listeners (the authenticator reads `registry.table` per request; shards, eviction priorities and
scheduling weights subscribe). An invalid table in the store is logged once and ignored: the
replica keeps serving with the last good one. So is a table that disappears from the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sits.runtime.tasks import PeriodicTask
from sits.runtime.tenancy.state_store import StateStore, TenantTableRecord
from sits.runtime.tenancy.tenants import TenantConfigError, TenantTable, parse_tenants

log = logging.getLogger(__name__)

Listener = Callable[[TenantTable], None]


class TenantRegistry:
    """Holds the current TenantTable and calls listeners when it is replaced."""

    def __init__(self, table: TenantTable) -> None:
        self._table = table
        self._listeners: list[Listener] = []

    @property
    def table(self) -> TenantTable:
        return self._table

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def replace(self, table: TenantTable) -> None:
        self._table = table
        for listener in self._listeners:
            listener(table)


class TenantSync:
    """Polls the store for new tenant-table versions.

    Args:
        registry: where the current table lives.
        store: the state store holding the shared table.
        poll_interval_s: seconds between version checks (one small read each).
        require_keys: False in trusted-gateway mode (tables without keys are valid).
    """

    def __init__(self, registry: TenantRegistry, store: StateStore, *, poll_interval_s: float = 2.0,
                 require_keys: bool = True) -> None:
        self.registry = registry
        self.store = store
        self.poll_interval_s = poll_interval_s
        self.require_keys = require_keys
        self.version = 0
        self._rejected_version = 0
        self._polling = PeriodicTask(self._poll_logged, poll_interval_s, "sits-tenant-sync")

    async def start(self, seed: TenantTable | None) -> None:
        """Adopt the stored table if there is one (an operator's live edits outlive restarts);
        otherwise store `seed` (the tenants file) for the other replicas. Then poll."""
        record = await self.store.get_tenant_table()
        if record is not None:
            self._adopt(record)
        elif seed is not None:
            self.version = await self.store.put_tenant_table(seed.to_document(), if_absent=True)
        self._polling.start()

    async def close(self) -> None:
        await self._polling.stop()

    async def poll_once(self) -> bool:
        """Check the store once; True if a new table was swapped in."""
        version = await self.store.tenant_table_version()
        if version in (0, self.version, self._rejected_version):
            return False
        record = await self.store.get_tenant_table()
        return record is not None and self._adopt(record)

    async def _poll_logged(self) -> None:
        try:
            await self.poll_once()
        except Exception:  # the store reports its own outages; anything else must not stop polling
            log.exception("tenant table poll failed; keeping the current table")

    def _adopt(self, record: TenantTableRecord) -> bool:
        try:
            table = parse_tenants(record.document, source=f"stored tenant table v{record.version}",
                                  require_keys=self.require_keys)
        except TenantConfigError as error:
            if record.version != self._rejected_version:
                log.error("%s; keeping the current tenant table", error)
                self._rejected_version = record.version
            return False
        self.version = record.version
        self.registry.replace(table)
        log.info("tenant table v%d applied: %d tenants", record.version, len(table))
        return True
