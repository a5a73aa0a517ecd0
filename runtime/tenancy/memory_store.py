"""The in-process state store (`--state-store memory://`): one replica, nothing shared, always up."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from sits.runtime.tenancy.rate_windows import WINDOW_S, Limits, WindowBook, window_index, window_position
from sits.runtime.tenancy.state_store import (
    Admission,
    EvictionIndexEntry,
    StateStore,
    TenantTableRecord,
    UsageBook,
)


class MemoryStateStore(StateStore):
    """Every StateStore operation on local dicts; no I/O, so nothing is ever pending."""

    def __init__(self, deployment: str = "default", replica_id: str | None = None,
                 window_s: float = WINDOW_S) -> None:
        super().__init__(deployment, replica_id)
        self.window_s = window_s
        self._table: TenantTableRecord | None = None
        self._usage = UsageBook()
        self._eviction_index: dict[str, EvictionIndexEntry] = {}
        self._windows = WindowBook()

    @property
    def up(self) -> bool:
        return True

    async def get_tenant_table(self) -> TenantTableRecord | None:
        return self._table

    async def put_tenant_table(self, document: Mapping[str, Any], *, if_absent: bool = False) -> int:
        if if_absent and self._table is not None:
            return self._table.version
        version = (self._table.version if self._table else 0) + 1
        self._table = TenantTableRecord(version, copy.deepcopy(dict(document)))
        return version

    async def tenant_table_version(self) -> int:
        return self._table.version if self._table else 0

    def add_usage(self, tenant: str, requests: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self._usage.add(tenant, requests, prompt_tokens, completion_tokens)

    async def get_usage(self) -> dict[str, dict[str, int]]:
        return self._usage.copy_out()

    def publish_eviction_index(self, entries: Mapping[str, EvictionIndexEntry]) -> None:
        self._eviction_index = dict(entries)

    async def get_eviction_index(self) -> dict[str, dict[str, EvictionIndexEntry]]:
        return {self.replica_id: dict(self._eviction_index)} if self._eviction_index else {}

    async def admit(self, tenant: str, now: float, limits: Limits, tokens: int) -> Admission:
        index, fraction = window_position(now, self.window_s)
        allowed, counts = self._windows.admit_local(tenant, index, fraction, limits, tokens)
        return Admission(allowed, counts, fraction, shared=False)

    def add_window_tokens(self, tenant: str, now: float, tokens: int) -> None:
        self._windows.add(tenant, window_index(now, self.window_s), 0, tokens)
