"""A replica's KV state through a real Redis: what `RedisStateStore.publish_kv_state` writes is what
the router's `KVStateReader` reads; only changes are sent, a lost state is rewritten, and a silent
replica's entries expire."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis

from sits.runtime.router.index import KVIndex
from sits.runtime.router.kv_events import KVStateReader
from sits.runtime.tenancy.redis_store import RedisStateStore
from sits.runtime.tenancy.state_store import ReplicaKVState

FAST = {"flush_interval_s": 0.05, "backoff_initial_s": 0.05, "backoff_max_s": 0.2, "op_timeout_s": 0.5}


def hashes(*seeds: int) -> frozenset[bytes]:
    return frozenset(bytes([seed]) * 32 for seed in seeds)


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_published_kv_state_reaches_the_router_and_expires(redis_service):
    deployment, url = f"kv-{uuid.uuid4().hex[:8]}", f"redis://127.0.0.1:{redis_service.port}/0"
    store = RedisStateStore(url, deployment=deployment, replica_id="r1", kv_ttl_s=1.0, **FAST)
    reader = KVStateReader(url, deployment, KVIndex())
    raw = redis.Redis(port=redis_service.port, decode_responses=True)
    key = f"sits:{deployment}:kv:r1"
    await store.start()
    try:
        store.publish_kv_state(ReplicaKVState(hashes(1, 2, 3), waiting=2, kv_usage=0.25))
        await store.flush()
        state = (await reader.read())["r1"]
        assert state.block_hashes == hashes(1, 2, 3) and state.waiting == 2 and state.kv_usage == 0.25
        version = raw.hget(f"sits:{deployment}:load:r1", "version")

        store.publish_kv_state(ReplicaKVState(hashes(2, 3, 4), waiting=0, kv_usage=0.0))
        await store.flush()
        assert raw.smembers(key) == {h.hex() for h in hashes(2, 3, 4)}
        assert raw.hget(f"sits:{deployment}:load:r1", "version") != version
        assert (await reader.read())["r1"].block_hashes == hashes(2, 3, 4)

        raw.flushdb()  # Redis lost everything behind a live connection: the replica writes it all back
        await eventually(lambda: asyncio.sleep(0, raw.scard(key) == 3))
        assert (await reader.read())["r1"].block_hashes == hashes(2, 3, 4)
    finally:
        await store.close()
    # A replica that stops publishing: a clean close removes its keys at once ...
    assert raw.exists(key) == 0 and await reader.read() == {}
    # ... and a crashed one's expire by themselves.
    crashed = RedisStateStore(url, deployment=deployment, replica_id="r2", kv_ttl_s=0.3, **FAST)
    await crashed.start()
    crashed.publish_kv_state(ReplicaKVState(hashes(9), waiting=0, kv_usage=0.0))
    await crashed.flush()
    assert set(await reader.read()) == {"r2"}
    await crashed._link.stop()  # no more writes, no clean retirement
    await eventually(lambda: asyncio.sleep(0, raw.exists(f"sits:{deployment}:kv:r2") == 0))
    assert await reader.read() == {}
    await crashed._link.aclose()
    await reader.close()


def test_the_tenant_policy_names_the_hashes_a_prompt_can_hit():
    from sits.runtime.engine.block_pool import BlockPool
    from sits.runtime.engine.eviction import BlockOwner
    from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy
    from sits.runtime.tenancy.tenants import TenantTable

    policy = TenantEvictionPolicy(4, TenantTable.open_access())
    pool = BlockPool(4, eviction_policy=policy)
    owner = BlockOwner("req-1", "default")
    first = pool.allocate(2, owner)
    assert first is not None
    for block, seed in zip(first, (1, 2), strict=True):
        pool.cache(block, bytes([seed]) * 32)
    assert policy.kv_usage() == 0.5
    pool.release(reversed(first))  # finished: both blocks stay findable
    assert policy.cached_block_hashes() == hashes(1, 2) and policy.kv_usage() == 0.0
    pool.touch([pool.lookup(bytes([1]) * 32)], BlockOwner("req-2", "default"))  # a hit keeps it
    assert policy.cached_block_hashes() == hashes(1, 2)
    taken = pool.allocate(3, BlockOwner("req-3", "default"))  # 2 empty + 1 evicted: block 2's hash goes
    assert taken is not None and policy.cached_block_hashes() == hashes(1)
