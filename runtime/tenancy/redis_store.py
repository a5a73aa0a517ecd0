"""The Redis state store (`--state-store redis://host:port/db`), shared by all replicas.

Keys (all under `sits:{deployment}:`):
    tenants              hash {version, document}: the tenant table (key digests only)
    replicas             hash replica -> last heartbeat (unix seconds)
    usage:{replica}      hash "{tenant}|{field}" -> this replica's total since it started
    usage:retired        hash "{tenant}|{field}" -> totals of replicas that shut down cleanly
    eviction:{replica}   hash tenant -> JSON EvictionIndexEntry
    kv:{replica}         set of hex prefix hashes the replica's cache holds (for `sits router`)
    load:{replica}       hash {waiting, kv_usage, blocks, version, published_at}: the replica's load, and
                         a version that changes whenever its kv set does (for the router)
                         (both expire `kv_ttl_s` after the replica's last write: a dead replica's
                         entries vanish; a live one sends only what changed, all after a restart)
    rl:{tenant}:{window} hash "r:{replica}" / "t:{replica}" -> requests / tokens in that window

Every value a replica writes is its own absolute count (usage totals, window counts raised with a
max), so writes are idempotent. That makes recovery simple: when Redis comes back (even empty,
after a restart without persistence) the replica rewrites all its state and nothing is counted
twice or lost.

Consistency: `admit` runs one Lua script per request that reads every replica's window counts,
decides and counts atomically, so a tenant's limit holds exactly across replicas while Redis is
up. A request that a replica already knows to be over the limit (from its own counts and the
others' last seen counts, a lower bound) is refused with no round trip. While Redis is down each
replica decides from its own counts plus the others' last seen counts; the cluster can then
exceed a limit by what the other replicas admit during the outage.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from redis.exceptions import RedisError

from sits.runtime.tenancy import redis_scripts
from sits.runtime.tenancy.rate_windows import (
    WINDOW_S,
    Limits,
    WindowBook,
    admits,
    window_index,
    window_position,
)
from sits.runtime.tenancy.redis_link import UNREACHABLE, LinkTiming, RedisLink
from sits.runtime.tenancy.state_store import (
    Admission,
    EvictionIndexEntry,
    ReplicaKVState,
    StateStore,
    TenantTableRecord,
    UsageBook,
)

log = logging.getLogger(__name__)


class StateStoreUnavailable(ConnectionError):
    """The write must reach the shared store now, and the store is down."""


class RedisStateStore(StateStore):
    """StateStore on Redis through redis-py's asyncio client.

    Args:
        url: redis://[:password@]host:port/db (or rediss://, unix://).
        flush_interval_s: how often pending writes are sent in one pipeline.
        op_timeout_s: socket connect and read timeout of each Redis call.
        backoff_initial_s, backoff_max_s: reconnection attempts back off exponentially between these.
        window_s: rate-limit window length.
        max_pending: pending keys that trigger a flush before the interval ends.
        replica_stale_s: replicas silent longer than this are left out of the eviction index.
        kv_ttl_s: the KV state's keys expire this long after the replica's last write.
    """

    def __init__(self, url: str, deployment: str = "default", replica_id: str | None = None, *,
                 flush_interval_s: float = LinkTiming.flush_interval_s, op_timeout_s: float = LinkTiming.op_timeout_s,
                 backoff_initial_s: float = LinkTiming.backoff_initial_s,
                 backoff_max_s: float = LinkTiming.backoff_max_s, window_s: float = WINDOW_S, max_pending: int = 1024,
                 replica_stale_s: float = 60.0, kv_ttl_s: float = 5.0) -> None:
        super().__init__(deployment, replica_id)
        timing = LinkTiming(flush_interval_s, op_timeout_s, backoff_initial_s, backoff_max_s)
        self._link = RedisLink(url, self._flush_once, self._write_back, timing)
        self._redis = self._link.client
        self.url = self._link.url
        self.flush_interval_s = flush_interval_s
        self.window_s = window_s
        self.max_pending = max_pending
        self.replica_stale_s = replica_stale_s
        self.kv_ttl_s = kv_ttl_s
        self._admit = self._redis.register_script(redis_scripts.ADMIT)
        self._raise_fields = self._redis.register_script(redis_scripts.RAISE_FIELDS)
        self._put_tenants = self._redis.register_script(redis_scripts.PUT_TENANTS)
        self._prefix = f"sits:{self.deployment}:"
        self._heartbeat_written = False
        self._closed = False
        # Local state: authoritative for this replica's own counts, a cache of everything else.
        self._table: TenantTableRecord | None = None
        self._table_pending = False  # a table seeded while down, to write if Redis has none
        self._usage = UsageBook()
        self._usage_dirty: set[str] = set()
        self._eviction_index: dict[str, EvictionIndexEntry] = {}
        self._eviction_dirty = False
        self._kv_state: ReplicaKVState | None = None
        self._kv_sent: frozenset[bytes] | None = None  # the hashes Redis holds (None: rewrite them all)
        self._kv_version = 0  # bumped with every change of the published hash set
        self._windows = WindowBook()

    def __repr__(self) -> str:
        return f"RedisStateStore({self.url!r}, deployment={self.deployment!r}, up={self.up})"

    @property
    def up(self) -> bool:
        return self._link.up

    def _key(self, *parts: str) -> str:
        return self._prefix + ":".join(parts)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._link.start(f"state store {self.url} is up (deployment {self.deployment}, "
                               f"replica {self.replica_id})")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._link.stop()
        if self._link.up:
            try:
                await self._flush_once()
                await self._retire()
            except UNREACHABLE as error:
                log.warning("state store %s: could not write final state: %s", self.url, error)
        await self._link.aclose()

    async def flush(self) -> None:
        await self._link.flush()

    # -- batched writes -------------------------------------------------------------------------

    async def _write_back(self) -> None:
        """Rewrite all local state (after a reconnect, or Redis lost it): idempotent."""
        self._usage_dirty.update(self._usage)
        self._eviction_dirty = True
        self._kv_sent = None
        index = window_index(time.time(), self.window_s)
        self._windows.dirty.update((t, i) for t, i, _, _ in self._windows.recent(index))
        if self._table is not None:
            version = max(1, self._table.version)
            stored = await self._put_tenants(keys=[self._key("tenants")],
                                             args=[json.dumps(self._table.document, sort_keys=True), "restore", version])
            self._table_pending = False
            if int(stored) != version:
                self._table = None  # Redis holds another table: read it on the next poll
        await self._flush_once(full=True)

    async def _flush_once(self, full: bool = False) -> None:
        usage_dirty, self._usage_dirty = self._usage_dirty, set()
        windows_dirty, self._windows.dirty = self._windows.dirty, set()
        eviction_dirty, self._eviction_dirty = self._eviction_dirty, False
        try:
            await self._send(usage_dirty, windows_dirty, eviction_dirty, full)
        except BaseException:
            self._usage_dirty |= usage_dirty
            self._windows.dirty |= windows_dirty
            self._eviction_dirty |= eviction_dirty
            raise

    async def _send(self, usage_dirty: set[str], windows_dirty: set[tuple[str, int]], eviction_dirty: bool,
                    full: bool) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hexists(self._key("replicas"), self.replica_id)  # gone: Redis lost our state
            if usage_dirty:
                pipe.hset(self._key("usage", self.replica_id), mapping={
                    f"{tenant}|{name}": value for tenant in usage_dirty for name, value in self._usage[tenant].items()})
            ttl = int(3 * self.window_s)
            current = window_index(time.time(), self.window_s)
            for tenant, index in windows_dirty:
                if index < current - 1:
                    continue
                requests, tokens = self._windows.mine[(tenant, index)]
                await self._raise_fields(keys=[self._key("rl", tenant, str(index))],
                                         args=[ttl, f"r:{self.replica_id}", requests, f"t:{self.replica_id}", tokens],
                                         client=pipe)
            if eviction_dirty:
                key = self._key("eviction", self.replica_id)
                pipe.delete(key)
                if self._eviction_index:
                    pipe.hset(key, mapping={t: json.dumps(asdict(e)) for t, e in self._eviction_index.items()})
            kv_sending = self._queue_kv_state(pipe, full)
            pipe.hset(self._key("replicas"), self.replica_id, f"{time.time():.3f}")
            results = await pipe.execute()
        if kv_sending is not None:
            self._kv_sent = kv_sending
        if not results[0] and self._heartbeat_written and not full:
            # Our heartbeat vanished: Redis restarted (or was flushed) behind a live connection.
            log.warning("state store %s lost this replica's state; writing it back", self.url)
            self._usage_dirty.update(self._usage)
            self._eviction_dirty = True
            self._kv_sent = None
            self._windows.dirty.update((t, i) for t, i, _, _ in self._windows.recent(current))
            self._link.wake()
        self._heartbeat_written = True

    def _queue_kv_state(self, pipe: Any, full: bool) -> frozenset[bytes] | None:
        """Queue this replica's KV state on `pipe`: the hashes that changed since the last write
        (all of them after a reconnect), its load, and fresh expiry times. Returns the hash set
        Redis will hold once the pipeline ran (None: nothing published yet)."""
        state = self._kv_state
        if state is None:
            return None
        key, ttl_ms = self._key("kv", self.replica_id), max(1, int(self.kv_ttl_s * 1000))
        sent = None if full else self._kv_sent
        removed: frozenset[bytes]
        if sent is None:
            pipe.delete(key)
            added, removed = state.block_hashes, frozenset()
        else:
            added, removed = state.block_hashes - sent, sent - state.block_hashes
        if removed:
            pipe.srem(key, *(h.hex() for h in removed))
        if added:
            pipe.sadd(key, *(h.hex() for h in added))
        if sent is None or added or removed:
            self._kv_version += 1
        pipe.pexpire(key, ttl_ms)
        load_key = self._key("load", self.replica_id)
        pipe.hset(load_key, mapping={"waiting": state.waiting, "kv_usage": f"{state.kv_usage:.4f}",
                                     "blocks": len(state.block_hashes), "version": f"{self.replica_id}/{self._kv_version}",
                                     "published_at": f"{time.time():.3f}"})
        pipe.pexpire(load_key, ttl_ms)
        return state.block_hashes

    async def _retire(self) -> None:
        """Fold this replica's usage into usage:retired and remove its keys, atomically."""
        async with self._redis.pipeline(transaction=True) as pipe:
            for tenant, usage in self._usage.items():
                for name, value in usage.items():
                    if value:
                        pipe.hincrby(self._key("usage", "retired"), f"{tenant}|{name}", value)
            pipe.delete(self._key("usage", self.replica_id), self._key("eviction", self.replica_id),
                        self._key("kv", self.replica_id), self._key("load", self.replica_id))
            pipe.hdel(self._key("replicas"), self.replica_id)
            await pipe.execute()

    def _pending(self) -> None:
        if len(self._usage_dirty) + len(self._windows.dirty) >= self.max_pending:
            self._link.wake()

    # -- tenant table ---------------------------------------------------------------------------

    async def get_tenant_table(self) -> TenantTableRecord | None:
        if self.up:
            try:
                version, document = await self._redis.hmget(self._key("tenants"), ["version", "document"])
            except UNREACHABLE as error:
                self._link.mark_down(error)
            else:
                if document is not None:
                    self._table = TenantTableRecord(int(version), json.loads(document))
                elif not self._table_pending:
                    self._table = None
        return self._table

    async def put_tenant_table(self, document: Mapping[str, Any], *, if_absent: bool = False) -> int:
        """Store a new table version. With if_absent (seeding from a tenants file) an existing
        table wins, and a store that is down keeps the table to write once it is back."""
        payload = json.dumps(dict(document), sort_keys=True)
        if not self.up:
            if not if_absent:
                raise StateStoreUnavailable(f"state store {self.url} is unreachable; the tenant table was not saved")
            self._table, self._table_pending = TenantTableRecord(0, json.loads(payload)), True
            return 0
        mode, version = ("restore", 1) if if_absent else ("put", 0)
        try:
            stored = int(await self._put_tenants(keys=[self._key("tenants")], args=[payload, mode, version]))
        except UNREACHABLE as error:
            self._link.mark_down(error)
            raise StateStoreUnavailable(f"state store {self.url} is unreachable; the tenant table was not saved") from None
        await self.get_tenant_table()
        return stored

    async def tenant_table_version(self) -> int:
        if self.up:
            try:
                version = await self._redis.hget(self._key("tenants"), "version")
                return int(version or 0)
            except UNREACHABLE as error:
                self._link.mark_down(error)
        return self._table.version if self._table else 0

    # -- usage and eviction index ---------------------------------------------------------------

    def add_usage(self, tenant: str, requests: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self._usage.add(tenant, requests, prompt_tokens, completion_tokens)
        self._usage_dirty.add(tenant)
        self._pending()

    async def get_usage(self) -> dict[str, dict[str, int]]:
        """All replicas' usage summed; this replica's from local state (it may be ahead of Redis).
        While Redis is down, this replica's usage only."""
        totals = UsageBook()
        if self.up:
            try:
                replicas = [r for r in await self._redis.hkeys(self._key("replicas")) if r != self.replica_id]
                async with self._redis.pipeline(transaction=False) as pipe:
                    for name in [*replicas, "retired"]:
                        pipe.hgetall(self._key("usage", name))
                    stored_usage = await pipe.execute()
                for stored in stored_usage:
                    for field, value in stored.items():
                        tenant, _, name = field.rpartition("|")
                        totals[tenant][name] += int(value)
            except UNREACHABLE as error:
                self._link.mark_down(error)
                totals.clear()
        for tenant, usage in self._usage.items():
            for name, value in usage.items():
                totals[tenant][name] += value
        return totals.copy_out()

    def publish_eviction_index(self, entries: Mapping[str, EvictionIndexEntry]) -> None:
        self._eviction_index = dict(entries)
        self._eviction_dirty = True

    def publish_kv_state(self, state: ReplicaKVState) -> None:
        self._kv_state = state

    async def get_eviction_index(self) -> dict[str, dict[str, EvictionIndexEntry]]:
        result = {self.replica_id: dict(self._eviction_index)} if self._eviction_index else {}
        if not self.up:
            return result
        try:
            heartbeats = await self._redis.hgetall(self._key("replicas"))
            fresh = [r for r, beat in heartbeats.items()
                     if r != self.replica_id and time.time() - float(beat) < self.replica_stale_s]
            async with self._redis.pipeline(transaction=False) as pipe:
                for name in fresh:
                    pipe.hgetall(self._key("eviction", name))
                stored_indexes = await pipe.execute()
            for name, stored in zip(fresh, stored_indexes, strict=True):
                if stored:
                    result[name] = {t: EvictionIndexEntry(**json.loads(v)) for t, v in stored.items()}
        except UNREACHABLE as error:
            self._link.mark_down(error)
        return result

    # -- rate-limit windows ---------------------------------------------------------------------

    async def admit(self, tenant: str, now: float, limits: Limits, tokens: int) -> Admission:
        index, fraction = window_position(now, self.window_s)
        known = self._windows.counts(tenant, index)  # a lower bound of the shared counts
        if not admits(known, fraction, limits, tokens):
            return Admission(False, known, fraction, shared=False)
        if self.up:
            try:
                return await self._admit_shared(tenant, index, fraction, limits, tokens)
            except UNREACHABLE as error:
                self._link.mark_down(error)
            except RedisError as error:
                log.warning("state store %s: rate-limit script failed (%s); deciding locally", self.url, error)
        allowed, counts = self._windows.admit_local(tenant, index, fraction, limits, tokens)
        return Admission(allowed, counts, fraction, shared=False)

    async def _admit_shared(self, tenant: str, index: int, fraction: float, limits: Limits,
                            tokens: int) -> Admission:
        mine_now = self._windows.mine.get((tenant, index), (0, 0))
        mine_prev = self._windows.mine.get((tenant, index - 1), (0, 0))
        allowed, cur_r, cur_t, prev_r, prev_t = await self._admit(
            keys=[self._key("rl", tenant, str(index)), self._key("rl", tenant, str(index - 1))],
            args=[f"r:{self.replica_id}", f"t:{self.replica_id}", mine_now[0], mine_now[1], mine_prev[0],
                  mine_prev[1], repr(1.0 - fraction), _limit(limits.requests), _limit(limits.tokens), tokens,
                  int(3 * self.window_s)])
        self._windows.set_others(tenant, index, int(cur_r), int(cur_t))
        self._windows.set_others(tenant, index - 1, int(prev_r), int(prev_t))
        if allowed:
            self._windows.add(tenant, index, 1, tokens)
        return Admission(bool(allowed), self._windows.counts(tenant, index), fraction, shared=True)

    def add_window_tokens(self, tenant: str, now: float, tokens: int) -> None:
        self._windows.add(tenant, window_index(now, self.window_s), 0, tokens)
        self._pending()


def _limit(value: int | None) -> int:
    return -1 if value is None else value

