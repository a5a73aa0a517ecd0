"""The Redis state store against a real redis-server: sharing, batching, namespacing, outages."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest
import redis

from sits.runtime.config import ConfigError
from sits.runtime.tenancy.memory_store import MemoryStateStore
from sits.runtime.tenancy.rate_windows import Limits, window_index
from sits.runtime.tenancy.redis_store import RedisStateStore, StateStoreUnavailable
from sits.runtime.tenancy.state_store import EvictionIndexEntry, open_state_store
from sits.runtime.tenancy.tenants import parse_tenants
from tests.support.services import redis_argv, redis_server, started

FAST = {"flush_interval_s": 0.05, "backoff_initial_s": 0.05, "backoff_max_s": 0.2, "op_timeout_s": 0.5}


@pytest.fixture
def deployment() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def stores(redis_service, deployment):
    """Makes started stores on the module's Redis and closes them after the test."""
    made: list[RedisStateStore] = []

    async def make(replica: str, **options) -> RedisStateStore:
        store = RedisStateStore(f"redis://127.0.0.1:{redis_service.port}/0", deployment=deployment,
                                replica_id=replica, **{**FAST, **options})
        await store.start()
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


def raw(service) -> redis.Redis:
    return redis.Redis(port=service.port, decode_responses=True)


async def test_tenant_table_updates_are_seen_by_every_replica(stores):
    a, b = await stores("a"), await stores("b")
    assert await b.get_tenant_table() is None and await b.tenant_table_version() == 0
    document = parse_tenants({"tenants": [{"name": "finance", "apiKey": "sk-live-secret", "priority": 3}]}).to_document()
    assert await a.put_tenant_table(document) == 1
    assert await b.tenant_table_version() == 1
    record = await b.get_tenant_table()
    assert parse_tenants(record.document).by_key("sk-live-secret").name == "finance"
    assert await a.put_tenant_table({"tenants": []}) == 2
    # Seeding from a file never overwrites what an operator stored.
    assert await b.put_tenant_table(document, if_absent=True) == 2
    assert (await b.get_tenant_table()).document == {"tenants": []}


async def test_usage_is_batched_and_summed_over_replicas(stores, redis_service, deployment):
    a, b = await stores("a"), await stores("b")
    a.add_usage("finance", requests=1, prompt_tokens=10, completion_tokens=20)
    b.add_usage("finance", requests=2, prompt_tokens=5)
    b.add_usage("lab", requests=1)
    assert not raw(redis_service).exists(f"sits:{deployment}:usage:a")  # nothing written synchronously
    await asyncio.sleep(0.3)  # a few flush intervals
    assert raw(redis_service).hgetall(f"sits:{deployment}:usage:a")["finance|prompt_tokens"] == "10"
    expected = {"finance": {"requests": 3, "prompt_tokens": 15, "completion_tokens": 20},
                "lab": {"requests": 1, "prompt_tokens": 0, "completion_tokens": 0}}
    assert await a.get_usage() == expected
    await a.close()  # a clean shutdown folds a's usage into the retired totals
    await a.close()  # and closing twice counts nothing twice
    assert await b.get_usage() == expected
    assert not raw(redis_service).exists(f"sits:{deployment}:usage:a")


async def test_eviction_index_is_published_per_replica(stores):
    a, b = await stores("a"), await stores("b")
    entry = EvictionIndexEntry(cached_blocks=12, held_blocks=40, guaranteed_blocks=32, lowest_score=7.5,
                               evictions_total=3)
    a.publish_eviction_index({"finance": entry})
    await a.flush()
    assert (await b.get_eviction_index())["a"] == {"finance": entry}


async def test_rate_windows_are_shared_and_exact_across_replicas(stores):
    a, b = await stores("a"), await stores("b")
    now = (window_index(time.time()) + 0.5) * 60  # the middle of the current window
    limits = Limits(requests=10, tokens=None)
    admitted = await asyncio.gather(*[(a if i % 2 else b).admit("t", now, limits, 1) for i in range(25)])
    assert sum(x.allowed for x in admitted) == 10
    assert all(x.shared for x in admitted if x.allowed)
    # A replica that already knows the tenant is over the limit (from its last round trip, which
    # saw every replica's counts) refuses with no round trip.
    assert not (await a.admit("t", now, limits, 1)).allowed
    refused = await a.admit("t", now, limits, 1)
    assert not refused.allowed and not refused.shared


async def test_deployments_never_see_each_others_keys(redis_service):
    url = f"redis://127.0.0.1:{redis_service.port}/0"
    one = RedisStateStore(url, deployment="one", replica_id="r", **FAST)
    two = RedisStateStore(url, deployment="two", replica_id="r", **FAST)
    await one.start()
    await two.start()
    try:
        await one.put_tenant_table({"tenants": [{"name": "x"}]})
        one.add_usage("x", requests=5)
        now = time.time()
        assert (await one.admit("x", now, Limits(1, None), 0)).allowed
        await one.flush()
        assert await two.get_tenant_table() is None
        assert await two.get_usage() == {}
        assert (await two.admit("x", now, Limits(1, None), 0)).allowed
        keys = raw(redis_service).keys("sits:one:*")
        assert keys and all(k.startswith("sits:one:") for k in keys)
    finally:
        await one.close()
        await two.close()


async def until(predicate, seconds: float) -> bool:
    """Poll `predicate` every 20 ms for up to `seconds` (generous: a loaded 2-core CI machine is slow to notice an
    outage); whether it came true."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_redis_killed_mid_load_then_restarted(caplog):
    """No call fails while Redis is down; afterwards Redis holds the replica's whole state again."""
    caplog.set_level(logging.INFO, logger="sits.runtime.tenancy.redis_store")
    results = {"admitted": 0, "down_seen": 0}
    stop = asyncio.Event()
    with redis_server() as service:
        port = service.port
        store = RedisStateStore(f"redis://127.0.0.1:{port}/0", deployment="crash", replica_id="r1", **FAST)
        await store.start()

        async def load() -> None:  # a steady stream of requests, as a server would make
            while not stop.is_set():
                decision = await store.admit("finance", time.time(), limits, 3)
                results["admitted"] += decision.allowed
                results["down_seen"] += not store.up
                store.add_usage("finance", requests=1, prompt_tokens=3)
                store.add_window_tokens("finance", time.time(), 2)
                store.publish_eviction_index({"finance": EvictionIndexEntry(results["admitted"], 0, 0, 0.0, 0)})
                await asyncio.sleep(0.002)

        task = None
        try:  # a failed assertion must still stop the load and close the store, or the loop's teardown waits on them
            document = parse_tenants({"tenants": [{"name": "finance", "apiKey": "sk-1", "requestsPerMinute": 10_000}]})
            await store.put_tenant_table(document.to_document())
            limits = Limits(requests=10_000, tokens=None)
            task = asyncio.create_task(load())
            await asyncio.sleep(0.3)
            service.kill()
            assert await until(lambda: not store.up, 10.0)
            assert (await store.get_tenant_table()).version == 1  # served from local state
            with pytest.raises(StateStoreUnavailable):
                await store.put_tenant_table({"tenants": []})
            with started(redis_argv(port), port, log_name="redis-again.log") as again:
                assert await until(lambda: store.up, 20.0)
                await asyncio.sleep(0.2)
                stop.set()
                await task  # the load never raised
                await store.flush()
                _check_written_back(raw(again), store)
                await store.close()  # while Redis is up: its final write succeeds
        finally:
            stop.set()
            if task is not None and not task.done():
                task.cancel()
            await store.close()  # after a failure (else a no-op)
    assert results["down_seen"] > 0 and results["admitted"] > 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1  # logged once per outage
    assert sum("reachable again" in m for m in messages) == 1


def _check_written_back(client: redis.Redis, store: RedisStateStore) -> None:
    """Redis holds the replica's usage, tenant table, current rate-limit windows and eviction index again."""
    usage = client.hgetall("sits:crash:usage:r1")
    assert int(usage["finance|requests"]) == store._usage["finance"]["requests"] > 0
    tenants = client.hgetall("sits:crash:tenants")
    assert tenants["version"] == "1" and "finance" in tenants["document"]
    for (tenant, index), (requests, tokens) in store._windows.mine.items():
        if index >= window_index(time.time()) - 1:
            window = client.hgetall(f"sits:crash:rl:{tenant}:{index}")
            assert (int(window["r:r1"]), int(window["t:r1"])) == (requests, tokens)
    assert client.hexists("sits:crash:eviction:r1", "finance")


async def test_a_store_started_while_redis_is_down_serves_and_catches_up(caplog):
    caplog.set_level(logging.INFO, logger="sits.runtime.tenancy.redis_store")
    with redis_server() as service:
        port = service.port
    # Nothing listens on `port` now.
    store = RedisStateStore(f"redis://:hunter2@127.0.0.1:{port}/0", deployment="late", replica_id="r", **FAST)
    await store.start()
    assert not store.up
    assert await store.put_tenant_table({"tenants": [{"name": "seeded"}]}, if_absent=True) == 0
    assert (await store.admit("t", time.time(), Limits(5, None), 0)).allowed
    store.add_usage("t", requests=1)
    with started(redis_argv(port), port, log_name="redis-late.log") as service:
        for _ in range(100):
            if store.up:
                break
            await asyncio.sleep(0.05)
        assert store.up
        client = raw(service)
        assert client.hget("sits:late:tenants", "version") == "1"
        assert client.hget("sits:late:usage:r", "t|requests") == "1"
        await store.close()
    assert "hunter2" not in caplog.text and "hunter2" not in repr(store)


async def test_open_state_store_picks_the_backend_from_the_url(redis_service):
    assert isinstance(open_state_store("memory://"), MemoryStateStore)
    store = open_state_store(f"redis://127.0.0.1:{redis_service.port}/0", deployment="pick", flush_interval_s=0.05)
    assert isinstance(store, RedisStateStore) and store.flush_interval_s == 0.05
    await store.close()
    with pytest.raises(ConfigError, match="--state-store must be") as error:
        open_state_store("postgres://user:pw@db/sits")
    assert "pw" not in str(error.value)
    with pytest.raises(ConfigError, match="deployment name"):
        open_state_store("memory://", deployment="bad name")
