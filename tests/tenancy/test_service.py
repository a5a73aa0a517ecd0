"""The assembled tenancy parts: config, the server resolver (401 / 429 through FastAPI), metrics."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry, generate_latest

from sits.runtime.config import ConfigError
from sits.runtime.engine.eviction import BlockOwner
from sits.runtime.server.errors import install_error_handlers
from sits.runtime.server.tenant import TenantGate, request_tenant
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.server_auth import TenancyResolver
from sits.runtime.tenancy.service import Tenancy

KEY = "sk-finance-top-secret"


@pytest.fixture
def tenants_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - {{name: finance, apiKey: "{KEY}", priority: 3, kvCacheShare: 0.5, requestsPerMinute: 2}}
  - {{name: lab, apiKey: "sk-lab", kvCacheShare: 0.25}}
""")
    return path


def app_for(tenancy: Tenancy) -> FastAPI:
    app = FastAPI()
    app.state.tenant_resolver = TenancyResolver.for_tenancy(tenancy)
    app.add_middleware(TenantGate, generation_paths={"/v1/completions"})
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(tenant: str = Depends(request_tenant)) -> dict:
        return {"tenant": tenant}

    return app


async def test_keys_are_required_and_limits_enforced_through_the_server_contract(tenants_file, caplog):
    caplog.set_level(logging.DEBUG)
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(tenants_file)))
    await tenancy.start()
    transport = httpx.ASGITransport(app=app_for(tenancy))
    async with httpx.AsyncClient(transport=transport, base_url="http://sits") as client:
        missing = await client.post("/v1/completions")
        assert missing.status_code == 401 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
        wrong = await client.post("/v1/completions", headers={"Authorization": "Bearer sk-nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = [await client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"}) for _ in range(2)]
        assert [r.json() for r in ok] == [{"tenant": "finance"}] * 2
        limited = await client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(limited.headers["retry-after"]) >= 1
        assert (await client.post("/v1/completions", headers={"Authorization": "Bearer sk-lab"})).status_code == 200
    await tenancy.close()
    assert KEY not in caplog.text and "sk-nope" not in caplog.text


async def test_without_tenants_everyone_is_default(tmp_path):
    tenancy = Tenancy.from_config(TenancyConfig())
    await tenancy.start()
    transport = httpx.ASGITransport(app=app_for(tenancy))
    async with httpx.AsyncClient(transport=transport, base_url="http://sits") as client:
        response = await client.post("/v1/completions")
        assert response.json() == {"tenant": "default"}
    assert tenancy.sync is None
    await tenancy.close()


async def test_metrics_carry_the_tenant_label(tenants_file):
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(tenants_file)))
    await tenancy.start()
    policy = tenancy.eviction_policy(num_blocks=100)
    assert policy.shards.guaranteed("finance") == 50
    finance = tenancy.table.get("finance")
    for _ in range(3):
        await tenancy.limiter.check(finance, 0)
    registry = CollectorRegistry()
    registry.register(tenancy.collector("smollm2", "stable"))
    text = generate_latest(registry).decode()
    assert 'sits_kv_blocks_guaranteed{model="smollm2",tenant="finance",track="stable"} 50.0' in text
    assert 'sits_kv_blocks_used{model="smollm2",tenant="lab",track="stable"} 0.0' in text
    assert 'sits_rate_limited_total{model="smollm2",tenant="finance",track="stable"} 1.0' in text
    assert 'sits_kv_evictions_total{model="smollm2",tenant="lab",track="stable"} 0.0' in text
    assert 'sits_state_store_up{model="smollm2",track="stable"} 1.0' in text
    await tenancy.close()


async def test_live_updates_reach_shards_and_queue_weights(tenants_file):
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(tenants_file), tenant_poll_interval_s=60))
    await tenancy.start()
    policy = tenancy.eviction_policy(num_blocks=100)
    queue = tenancy.fair_queue()
    document = tenancy.table.to_document()
    document["tenants"][1].update(kvCacheShare=0.5, weight=4.0)
    document["tenants"][0]["kvCacheShare"] = 0.1
    await tenancy.store.put_tenant_table(document)
    assert await tenancy.sync.poll_once()
    policy.can_allocate(BlockOwner("r", "lab"), 1)  # the engine thread's next allocation applies it
    assert policy.shards.guaranteed("lab") == 50 and policy.shards.guaranteed("finance") == 10
    assert queue.queue._weights["lab"] == 4.0
    await tenancy.close()


@pytest.mark.parametrize(("config", "flag"), [
    (TenancyConfig(deployment="no spaces"), "--deployment"),
    (TenancyConfig(trusted_gateway_header="x-tenant"), "--trusted-gateway-header needs --tenants"),
    (TenancyConfig(eviction_alpha=-1), "--eviction-alpha"),
    (TenancyConfig(eviction_ttl_s=-5), "--eviction-ttl"),
    (TenancyConfig(state_store="mysql://x"), "--state-store"),
])
def test_bad_options_name_the_flag(config, flag):
    with pytest.raises(ConfigError, match=flag):
        Tenancy.from_config(config)


def test_gateway_mode_takes_tenants_without_keys(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants: [{name: a}, {name: b}]")
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(path), trusted_gateway_header="X-Tenant"))
    assert tenancy.authenticate({"x-tenant": "b"}).name == "b"
