"""Live tenant-table updates through the state store reach every replica; bad tables are ignored."""

from __future__ import annotations

import logging
import uuid

from sits.runtime.tenancy.auth import Authenticator
from sits.runtime.tenancy.memory_store import MemoryStateStore
from sits.runtime.tenancy.redis_store import RedisStateStore
from sits.runtime.tenancy.tenant_sync import TenantRegistry, TenantSync
from sits.runtime.tenancy.tenants import parse_tenants


def table(*entries):
    return parse_tenants({"tenants": [dict(e) for e in entries]})


async def test_the_file_seeds_the_store_and_a_stored_table_wins_on_restart():
    store = MemoryStateStore()
    seed = table({"name": "a", "apiKey": "sk-a"})
    registry = TenantRegistry(seed)
    sync = TenantSync(registry, store, poll_interval_s=60)
    await sync.start(seed)
    assert (await store.get_tenant_table()).version == 1
    await store.put_tenant_table(table({"name": "a", "apiKey": "sk-a2"}).to_document())  # an operator's edit
    await sync.close()
    restarted = TenantRegistry(seed)
    again = TenantSync(restarted, store, poll_interval_s=60)
    await again.start(seed)  # the stored (newer) table wins over the file
    assert restarted.table.by_key("sk-a2") is not None and restarted.table.by_key("sk-a") is None
    await again.close()


async def test_updates_reach_listeners_and_the_authenticator(caplog):
    store = MemoryStateStore()
    seed = table({"name": "a", "apiKey": "sk-a", "priority": 1})
    registry = TenantRegistry(seed)
    seen = []
    registry.subscribe(seen.append)
    sync = TenantSync(registry, store, poll_interval_s=60)
    await sync.start(seed)
    auth = Authenticator(lambda: registry.table)
    assert not await sync.poll_once()  # nothing new
    await store.put_tenant_table(table({"name": "a", "apiKey": "sk-a", "priority": 3},
                                       {"name": "b", "apiKey": "sk-b"}).to_document())
    assert await sync.poll_once()
    assert seen and seen[-1].get("a").priority == 3
    assert auth.authenticate({"authorization": "Bearer sk-b"}).name == "b"
    # An invalid table is logged once and ignored.
    caplog.set_level(logging.ERROR, logger="sits.runtime.tenancy.tenant_sync")
    await store.put_tenant_table({"tenants": [{"name": "a", "apiKeySha256": "a" * 64, "priority": 9}]})
    assert not await sync.poll_once() and not await sync.poll_once()
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]  # other tests may enable INFO
    assert len(errors) == 1 and "priority must be between 0 and 3" in errors[0].getMessage()
    assert registry.table.get("b") is not None
    await sync.close()


async def test_two_replicas_follow_one_redis_table(redis_service):
    url, deployment = f"redis://127.0.0.1:{redis_service.port}/0", f"sync-{uuid.uuid4().hex[:8]}"
    stores = [RedisStateStore(url, deployment=deployment, replica_id=f"r{i}", flush_interval_s=0.05) for i in range(2)]
    seed = table({"name": "a", "apiKey": "sk-a"})
    registries = [TenantRegistry(seed) for _ in stores]
    syncs = [TenantSync(r, s, poll_interval_s=60) for r, s in zip(registries, stores, strict=True)]
    for store, sync in zip(stores, syncs, strict=True):
        await store.start()
        await sync.start(seed)
    await stores[0].put_tenant_table(table({"name": "a", "apiKey": "sk-a"}, {"name": "new", "apiKey": "sk-n"})
                                     .to_document())
    assert await syncs[1].poll_once()
    assert registries[1].table.by_key("sk-n").name == "new"
    for store, sync in zip(stores, syncs, strict=True):
        await sync.close()
        await store.close()
