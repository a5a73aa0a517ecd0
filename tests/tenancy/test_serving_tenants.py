"""Tenants through the real server (uvicorn, a tiny random Llama) and the official openai client:
API keys (401), rate limits (429), time-ordered ids, per-tenant prefix caches (zero cross-tenant
hits, shown on /metrics), the shared-prefix pool, trusted-gateway and open modes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.models.loading import load_model
from sits.runtime.server.app import build_app
from sits.runtime.server.request_ids import uuid7_time
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.service import Tenancy

FINANCE_KEY, LAB_KEY, METERED_KEY, SMALL_KEY = "sk-finance-6f1c2e", "sk-lab-90ab7d", "sk-metered-33e0c1", "sk-small-0c4"
TENANTS_YAML = f"""
sharedPrefixPool: true
tenants:
  - {{name: finance, apiKey: "{FINANCE_KEY}", priority: 3, kvCacheShare: 0.4}}
  - {{name: lab, apiKey: "{LAB_KEY}", priority: 1, kvCacheShare: 0.4}}
  - {{name: metered, apiKeySha256: "{hashlib.sha256(METERED_KEY.encode()).hexdigest()}", requestsPerMinute: 2}}
  - {{name: small, apiKey: "{SMALL_KEY}"}}
"""
# ~120 tokens: several full 16-token blocks to hit.
LONG_PROMPT = ("Quarterly report. Revenue grew in every region; costs fell in logistics and rose in research. "
               "The board asks each team to summarise risks, hiring plans and the budget for next year. ") * 3


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    config = ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256)
    return load_model(config, TorchAttentionBackend(), progress=False)


def serve(tiny, tenancy: Tenancy) -> BackgroundServer:
    """A server as `sits serve` builds it: the tenancy's engine hooks, its eviction-index task, the app."""
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=256),
                          cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(tiny, config, **tenancy.engine_hooks()))
    engine.add_periodic(tenancy.publish_eviction_index, 0.1)
    return BackgroundServer(build_app(engine, ServerConfig(track="stable"), served_model_name="tiny-llama",
                                      tenancy=tenancy))


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenancy") / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    return path


@pytest.fixture(scope="module")
def served(tiny, tenants_file) -> Iterator[tuple[BackgroundServer, Tenancy]]:
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(tenants_file)))
    with serve(tiny, tenancy) as server:
        yield server, tenancy


def client_for(server: BackgroundServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def metrics(server: BackgroundServer) -> dict[tuple[str, str], float]:
    """(sample name, tenant label) -> value from /metrics, summed over other labels (e.g. status)."""
    values: dict[tuple[str, str], float] = {}
    # with tenants /metrics on the API port needs an admin's key: read the same exposition in process
    for family in text_string_to_metric_families(server.app.state.metrics.exposition().decode()):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("tenant", ""))
            values[key] = values.get(key, 0.0) + sample.value
    return values


def complete(client: openai.OpenAI, prompt: str, **extra):
    return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0,
                                     extra_body=extra or None)


def test_every_v1_call_needs_a_valid_key_and_keys_are_never_logged(served, caplog):
    server, _ = served
    caplog.set_level(logging.DEBUG)
    missing = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError) as wrong:
        client_for(server, "sk-not-a-tenant").models.list()
    assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        complete(client_for(server, FINANCE_KEY + "x"), "hi")
    # Authentication comes before the body is read: a broken body without a key is a 401, with one a 400.
    broken = b'{"prompt": "hi", '
    assert httpx.post(f"{server.url}/v1/completions", content=broken).status_code == 401
    keyed = httpx.post(f"{server.url}/v1/completions", content=broken, headers={"Authorization": f"Bearer {LAB_KEY}"})
    assert keyed.status_code == 400
    assert [m.id for m in client_for(server, LAB_KEY).models.list().data] == ["tiny-llama"]
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    for secret in (FINANCE_KEY, LAB_KEY, "sk-not-a-tenant"):
        assert secret not in caplog.text


def test_a_tenant_is_served_with_a_time_ordered_request_id(served):
    server, _ = served
    raw = client_for(server, FINANCE_KEY).completions.with_raw_response.create(
        model="tiny-llama", prompt="Hello", max_tokens=2)
    completion = raw.parse()
    assert completion.id == raw.headers["x-request-id"] and completion.id.startswith("cmpl-")
    assert abs(uuid7_time(completion.id) - time.time()) < 60
    later = complete(client_for(server, FINANCE_KEY), "Hello")
    assert later.id > completion.id  # ids sort by creation
    assert metrics(server)[("sits_requests_total", "finance")] >= 2


def test_over_its_requests_per_minute_a_tenant_gets_429_with_retry_after(served):
    server, _ = served
    client = client_for(server, METERED_KEY)
    for _ in range(2):
        complete(client, "one more")
    with pytest.raises(openai.RateLimitError) as limited:
        complete(client, "one too many")
    error = limited.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    assert "requests per min" in error.message
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.response.headers["x-ratelimit-limit-requests"] == "2"
    complete(client_for(server, FINANCE_KEY), "other tenants are not limited")
    values = metrics(server)
    assert values[("sits_rate_limited_total", "metered")] == 1
    assert values[("sits_rate_limited_total", "finance")] == 0
    assert values[("sits_requests_total", "metered")] == 3  # 2 served and the 429, under its tenant


def test_two_tenants_never_hit_each_others_prefix_cache(served):
    server, _ = served
    finance, lab = client_for(server, FINANCE_KEY), client_for(server, LAB_KEY)
    cached = {}
    for name, client in (("finance", finance), ("lab", lab), ("finance", finance), ("lab", lab)):
        usage = complete(client, LONG_PROMPT).usage
        cached.setdefault(name, []).append(usage.prompt_tokens_details.cached_tokens)
    # The same prompt: each tenant computes it once, then hits its own copy, never the other's.
    assert cached["finance"][0] == 0 and cached["lab"][0] == 0
    assert cached["finance"][1] >= 96 and cached["lab"][1] >= 96
    values = metrics(server)
    assert values[("sits_prefix_cache_hits_total", "finance")] >= 96
    assert values[("sits_prefix_cache_hits_total", "lab")] >= 96
    assert all(v == 0 for (name, _), v in values.items() if name == "sits_prefix_cache_cross_tenant_hits_total")
    assert values[("sits_kv_blocks_used", "finance")] >= 6 and values[("sits_kv_blocks_used", "lab")] >= 6
    assert values[("sits_kv_blocks_guaranteed", "finance")] == 25  # floor(0.4 x 64)


def test_prompts_marked_shared_hit_one_pool_across_tenants(served):
    server, _ = served
    system_prompt = "You are the assistant of ACME Corp. Answer briefly and cite the policy. " * 4
    first = complete(client_for(server, FINANCE_KEY), system_prompt, shared_prefix=True)
    again = complete(client_for(server, LAB_KEY), system_prompt, shared_prefix=True)
    private = complete(client_for(server, LAB_KEY), system_prompt)  # not marked: lab's own cache
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 48
    assert private.usage.prompt_tokens_details.cached_tokens == 0
    values = metrics(server)
    assert values[("sits_prefix_cache_shared_hits_total", "lab")] >= 48
    assert all(v == 0 for (name, _), v in values.items() if name == "sits_prefix_cache_cross_tenant_hits_total")


def test_a_tenants_context_is_what_its_kv_share_can_hold(served):
    server, _ = served
    # small has no guarantee: it can hold the 14 blocks (224 tokens) nobody is guaranteed, < the model's 256.
    client = client_for(server, SMALL_KEY)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=230, stream=stream)
        assert refused.value.code == "context_length_exceeded" and "224 tokens" in refused.value.message
    # Without max_tokens a chat may run to the end of that room, never beyond.
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.total_tokens == 224 and chat.choices[0].finish_reason == "length"


def test_usage_and_the_eviction_index_reach_the_state_store(served):
    server, tenancy = served
    complete(client_for(server, LAB_KEY), LONG_PROMPT)  # leaves >= 6 full blocks cached for lab
    usage = asyncio.run(tenancy.store.get_usage())
    assert usage["lab"]["requests"] >= 1 and usage["lab"]["completion_tokens"] >= 2

    def lab_index():  # published by the engine thread every 0.1 s while busy, and once when idle
        return asyncio.run(tenancy.store.get_eviction_index()).get(tenancy.store.replica_id, {}).get("lab")

    deadline = time.monotonic() + 10
    while (lab_index() is None or lab_index().cached_blocks < 6) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lab_index().cached_blocks >= 6 and lab_index().held_blocks >= 6
    assert lab_index().guaranteed_blocks == 25


def test_behind_a_trusted_gateway_the_tenant_comes_from_its_header(tiny, tenants_file):
    config = TenancyConfig(tenants_file=str(tenants_file), trusted_gateway_header="X-Sits-Tenant")
    with serve(tiny, Tenancy.from_config(config)) as server:
        body = {"prompt": "hi", "max_tokens": 1}
        ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Sits-Tenant": "lab"})
        assert ok.status_code == 200
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 401
        unknown = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Sits-Tenant": "nobody"})
        assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "invalid_tenant"
        assert metrics(server)[("sits_requests_total", "lab")] == 1


def test_without_tenants_the_server_is_open_and_has_no_shared_pool(tiny):
    with serve(tiny, Tenancy.from_config(TenancyConfig())) as server:
        client = client_for(server, "anything")
        assert complete(client, "hi").usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError) as refused:
            complete(client, "hi", shared_prefix=True)
        assert refused.value.body["param"] == "shared_prefix"
        values = metrics(server)
        assert values[("sits_requests_total", "default")] == 2
        assert values[("sits_kv_blocks_guaranteed", "default")] == 64


def test_a_full_queue_answers_401_before_503_and_admits_again_once_it_drains(served):
    server, _ = served
    admission = server.app.state.admission
    hold: dict = {}
    admission.reserve(hold, admission.capacity - admission.in_flight)  # every slot taken, as under a flood
    try:
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1}
        anonymous = httpx.post(f"{server.url}/v1/completions", json=body)
        assert anonymous.status_code == 401  # who you are first: a client without a key cannot fix that by waiting
        keyed = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {SMALL_KEY}"})
        assert keyed.status_code == 503 and keyed.json()["error"]["code"] == "server_overloaded"
        assert int(keyed.headers["retry-after"]) >= 1
        assert metrics(server)[("sits_requests_total", "small")] >= 1  # counted under the tenant, not "unknown"
    finally:
        admission.release(hold)
    assert complete(client_for(server, SMALL_KEY), "hi").choices[0].text is not None
