"""Reading the replicas' KV state (`StateStore.publish_kv_state`) from Redis into a KVIndex.

Keys (under `sits:{deployment}:`, written by `RedisStateStore`): `kv:{replica}`, a set of hex
prefix hashes, and `load:{replica}`, a hash {waiting, kv_usage, blocks, published_at}; both expire a
few seconds after the replica's last write, so a dead replica's entries vanish by themselves.
The reader polls: each round reads the `load` hash of every replica with a heartbeat (`replicas`),
and a replica's `kv` set only when its `version` changed since the last read (sets are large, loads
small).
While Redis is down the index is emptied (routing falls back to load and the router's history) and
rebuilt from the first read after it returns; replicas rewrite their whole state on reconnect.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sits.runtime.router.index import KVIndex, ReplicaKV
from sits.runtime.tasks import PeriodicTask
from sits.runtime.tenancy.redis_link import UNREACHABLE
from sits.runtime.tenancy.state_store import redact_url

log = logging.getLogger(__name__)


class KVStateReader:
    """Polls the store every `interval_s` seconds and replaces `index` with what it read.

    Args:
        url: the replicas' --state-store (redis://...).
        deployment: the replicas' --deployment.
        index: the KVIndex to fill.
        interval_s: seconds between reads.
        op_timeout_s: connect and read timeout of each Redis call.
    """

    def __init__(self, url: str, deployment: str, index: KVIndex, *, interval_s: float = 0.5,
                 op_timeout_s: float = 0.5) -> None:
        self.url = redact_url(url)
        self.index = index
        self.interval_s = interval_s
        self._prefix = f"sits:{deployment}:"
        self._redis = aioredis.Redis.from_url(url, socket_timeout=op_timeout_s,
                                              socket_connect_timeout=op_timeout_s, decode_responses=True)
        self.up = False
        self.reads = 0  # successful reads (tests wait on it)
        self._reading = PeriodicTask(self._refresh, interval_s, "sits-router-kv-reader", run_first=True)
        self._down_logged = False
        self._sets: dict[str, tuple[str, frozenset[bytes]]] = {}  # replica -> (version, its hash set)

    async def start(self) -> None:
        self._reading.start()

    async def close(self) -> None:
        await self._reading.stop()
        await self._redis.aclose()

    async def _refresh(self) -> None:
        """One round: replace the index with a fresh read, or empty it while the store is unreachable."""
        try:
            self.index.replace(await self.read())
        except (*UNREACHABLE, RedisError) as error:
            if self.up or not self._down_logged:
                log.warning("router: state store %s unreachable (%s); routing by load until it returns",
                            self.url, error)
                self._down_logged = True
            self.up = False
            self.index.clear()
            return
        if not self.up:
            log.info("router: reading replicas' KV state from %s", self.url)
        self.up = True
        self.reads += 1

    async def read(self) -> dict[str, ReplicaKV]:
        """{replica id: its KV state} for every replica whose state has not expired."""
        names = [str(name) for name in await self._redis.hkeys(self._prefix + "replicas")]
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self._prefix + "load:" + name)
            loads = await pipe.execute()
        live = {name: load for name, load in zip(names, loads, strict=True) if load}
        stale = [name for name, load in live.items()
                 if name not in self._sets or self._sets[name][0] != load.get("version")]
        if stale:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name in stale:
                    pipe.smembers(self._prefix + "kv:" + name)
                members = await pipe.execute()
            for name, hashes in zip(stale, members, strict=True):
                try:
                    self._sets[name] = (live[name].get("version", ""), frozenset(bytes.fromhex(h) for h in hashes))
                except ValueError:
                    log.warning("router: replica %s published a malformed KV state; ignored", name)
                    live.pop(name)
        self._sets = {name: entry for name, entry in self._sets.items() if name in live}
        states = {}
        for name, load in live.items():
            try:
                states[name] = ReplicaKV(self._sets[name][1], int(load.get("waiting", 0)),
                                         float(load.get("kv_usage", 0.0)), float(load.get("published_at", 0.0)))
            except (KeyError, ValueError):
                log.warning("router: replica %s published a malformed load; ignored", name)
        return states
