"""Where tenancy state lives beyond one process: the StateStore contract and how to open one.

`--state-store memory://` (the default) keeps everything in this process; `--state-store
redis://host:port/db` shares it between replicas through Redis (`redis_store.RedisStateStore`).

What a store holds, per deployment:
- the tenant table (digests, never keys), versioned so replicas pick up live edits;
- per-tenant usage counters (requests, prompt and completion tokens);
- the eviction index (each replica's cached blocks and lowest score per tenant);
- each replica's KV state for the router: the prefix hashes it holds and its load, expiring
  when the replica stops publishing (`ReplicaKVState`);
- rate-limit windows, shared by all replicas.

Calls on the serving path never wait for the network: `add_usage`, `add_window_tokens` and
`publish_eviction_index` only update local state that a background task writes in batches.
`admit` (once per request, never per engine step) makes one atomic round trip when the store is up
and decides from local state when it is not. A store that cannot reach its backend keeps
serving, reports `up == False`, and writes its local state back when the backend returns.
"""

from __future__ import annotations

import os
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sits.runtime.config import ConfigError
from sits.runtime.tenancy.rate_windows import Limits, WindowCounts

DEPLOYMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens")


class UsageBook(dict[str, dict[str, int]]):
    """Usage totals per tenant, {tenant: {field: count}} over USAGE_FIELDS; a tenant not seen yet
    reads as zeros (and is then held)."""

    def __missing__(self, tenant: str) -> dict[str, int]:
        usage = self[tenant] = dict.fromkeys(USAGE_FIELDS, 0)
        return usage

    def add(self, tenant: str, requests: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        usage = self[tenant]
        usage["requests"] += requests
        usage["prompt_tokens"] += prompt_tokens
        usage["completion_tokens"] += completion_tokens

    def copy_out(self) -> dict[str, dict[str, int]]:
        """A plain copy, safe to hand out."""
        return {tenant: dict(usage) for tenant, usage in self.items()}


@dataclass(frozen=True)
class TenantTableRecord:
    """The tenant table as stored: `document` is `TenantTable.to_document()`; `version` grows by
    one on every put."""

    version: int
    document: dict[str, Any]


@dataclass(frozen=True)
class Admission:
    """The answer of `StateStore.admit`: admitted or not, and the window counts it was decided on
    (after counting this request when admitted)."""

    allowed: bool
    counts: WindowCounts
    fraction: float  # of the current window elapsed at decision time
    shared: bool  # decided atomically in the shared store (False: from local state)


@dataclass(frozen=True)
class EvictionIndexEntry:
    """One replica's cached KV blocks of one tenant."""

    cached_blocks: int
    held_blocks: int
    guaranteed_blocks: int
    lowest_score: float
    evictions_total: int


@dataclass(frozen=True)
class ReplicaKVState:
    """What a replica tells the router about its KV cache (`sits router --policy precise`).

    Attributes:
        block_hashes: prefix hashes (`sits.runtime.engine.prefix_hash`, 32 bytes each) a prompt
            can hit on this replica now; at most the cache's block count.
        waiting: requests queued for admission.
        kv_usage: fraction of KV blocks referenced by running requests, 0..1.
    """

    block_hashes: frozenset[bytes]
    waiting: int
    kv_usage: float


class StateStore(ABC):
    """Tenancy state of one deployment (see the module docstring).

    Args:
        deployment: namespaces every key (`sits:{deployment}:...`), so deployments can share one
            Redis.
        replica_id: this process's name among the replicas; unique by default.
    """

    def __init__(self, deployment: str = "default", replica_id: str | None = None) -> None:
        if not DEPLOYMENT_NAME.match(deployment):
            raise ConfigError(f"deployment name must be letters, digits, '.', '_' or '-', got {deployment!r}")
        self.deployment = deployment
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}"

    @property
    @abstractmethod
    def up(self) -> bool:
        """Whether the backend is reachable (the `sits_state_store_up` gauge)."""

    async def start(self) -> None:  # noqa: B027 - optional for stores without I/O
        """Connect and start background writes; never raises because the backend is down."""

    async def close(self) -> None:  # noqa: B027 - optional for stores without I/O
        """Write what is pending (best effort) and stop."""

    async def flush(self) -> None:  # noqa: B027 - optional for stores without I/O
        """Write pending state now instead of at the next batch."""

    # -- tenant table ---------------------------------------------------------------------------

    @abstractmethod
    async def get_tenant_table(self) -> TenantTableRecord | None:
        """The stored table (the last one seen, while the backend is down), or None."""

    @abstractmethod
    async def put_tenant_table(self, document: Mapping[str, Any], *, if_absent: bool = False) -> int:
        """Store a new table and return its version. With if_absent (seeding the store from a
        tenants file) a stored table wins and its version is returned."""

    @abstractmethod
    async def tenant_table_version(self) -> int:
        """The stored table's version (0: none); cheap enough to poll."""

    # -- usage ----------------------------------------------------------------------------------

    @abstractmethod
    def add_usage(self, tenant: str, requests: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Count usage; returns at once (written in the next batch)."""

    @abstractmethod
    async def get_usage(self) -> dict[str, dict[str, int]]:
        """Usage per tenant over all replicas: {tenant: {"requests": n, "prompt_tokens": n, ...}}."""

    # -- eviction index -------------------------------------------------------------------------

    @abstractmethod
    def publish_eviction_index(self, entries: Mapping[str, EvictionIndexEntry]) -> None:
        """Replace this replica's eviction index; returns at once."""

    @abstractmethod
    async def get_eviction_index(self) -> dict[str, dict[str, EvictionIndexEntry]]:
        """{replica_id: {tenant: entry}} for every replica that published one."""

    def publish_kv_state(self, state: ReplicaKVState) -> None:  # noqa: B027 - only shared stores publish
        """Replace this replica's KV state for routers; returns at once (a local store ignores it:
        no router can read it)."""

    # -- rate-limit windows ---------------------------------------------------------------------

    @abstractmethod
    async def admit(self, tenant: str, now: float, limits: Limits, tokens: int) -> Admission:
        """Decide and, if admitted, count one request of `tokens` tokens, across all replicas."""

    @abstractmethod
    def add_window_tokens(self, tenant: str, now: float, tokens: int) -> None:
        """Count tokens (e.g. completion tokens) in the window of `now`; returns at once."""


def redact_url(url: str) -> str:
    """The URL with any password replaced, fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def open_state_store(url: str = "memory://", *, deployment: str = "default", replica_id: str | None = None,
                     **options: Any) -> StateStore:
    """The store a `--state-store` URL names; raises ConfigError for anything else.

    Options are passed to the Redis store (flush_interval_s, timeouts, backoff; see
    RedisStateStore); the in-memory store has none and ignores them.
    """
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        from sits.runtime.tenancy.memory_store import MemoryStateStore

        return MemoryStateStore(deployment=deployment, replica_id=replica_id)
    if scheme in ("redis", "rediss", "unix"):
        from sits.runtime.tenancy.redis_store import RedisStateStore

        return RedisStateStore(url, deployment=deployment, replica_id=replica_id, **options)
    raise ConfigError(f"--state-store must be memory:// or redis://host:port/db, got {redact_url(url)!r}")
