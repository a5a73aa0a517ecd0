"""The host KV tier's tenant policy through the tenancy service: guarantees from hostKvCacheShare
(not kvCacheShare), handed to the engine with its other hooks, following live table updates."""

from __future__ import annotations

from sits.runtime.engine.eviction import BlockOwner
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.service import Tenancy


async def test_the_host_policy_guarantees_host_shares_and_follows_live_updates(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("""
tenants:
  - {name: finance, apiKey: "sk-finance-0123", kvCacheShare: 0.5, hostKvCacheShare: 0.2}
  - {name: lab, apiKey: "sk-lab-0123", kvCacheShare: 0.25, hostKvCacheShare: 0.7}
""")
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(path), tenant_poll_interval_s=60))
    await tenancy.start()
    hooks = tenancy.engine_hooks()
    host = hooks["host_eviction_policy"](100)
    gpu = hooks["eviction_policy"](100)
    assert (host.shards.guaranteed("finance"), host.shards.guaranteed("lab")) == (20, 70)
    assert (gpu.shards.guaranteed("finance"), gpu.shards.guaranteed("lab")) == (50, 25)
    document = tenancy.table.to_document()
    document["tenants"][0]["hostKvCacheShare"] = 0.6
    document["tenants"][1]["hostKvCacheShare"] = 0.1
    await tenancy.store.put_tenant_table(document)
    assert await tenancy.sync.poll_once()
    host.can_allocate(BlockOwner("r", "lab"), 1)  # the engine thread's next allocation applies it
    assert (host.shards.guaranteed("finance"), host.shards.guaranteed("lab")) == (60, 10)
    await tenancy.close()
