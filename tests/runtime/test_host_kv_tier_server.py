"""The host KV tier behind the OpenAI-compatible server: two tenants with hostKvCacheShare, the
official openai client, /metrics scraped over HTTP. A tenant's long prompt pushed out of the GPU
cache comes back from the host tier (cached_tokens, tier="host" hits, same greedy text), and the
other tenant's identical prompt never does."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.models.loading import load_model
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.service import Tenancy

MODEL, MAX_MODEL_LEN, BLOCK = "tiny-llama", 96, 4
KEYS = {"acme": "sk-acme-0a1b2c3d", "globex": "sk-globex-4e5f6a7b", "ops": "sk-ops-8c9d0e1f"}
TENANTS_YAML = f"""
tenants:
  - {{name: acme, apiKey: "{KEYS['acme']}", kvCacheShare: 0.0, hostKvCacheShare: 0.5}}
  - {{name: globex, apiKey: "{KEYS['globex']}", kvCacheShare: 0.0, hostKvCacheShare: 0.5}}
  - {{name: ops, apiKey: "{KEYS['ops']}", admin: true, kvCacheShare: 0.0, hostKvCacheShare: 0.0}}
"""  # ops: an admin, whose key reads /metrics (with tenants it is not open on the API port)
HOST_BLOCKS = 64


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory) -> Iterator[BackgroundServer]:
    tenants = tmp_path_factory.mktemp("host-tier") / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(tenants)))
    loaded = load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                    max_model_len=MAX_MODEL_LEN), TorchAttentionBackend(), progress=False)
    c = loaded.config
    block_bytes = 2 * c.num_hidden_layers * BLOCK * c.num_key_value_heads * c.head_dim * 4
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(block_size=BLOCK, num_blocks=24,
                                            host_kv_cache_gb=HOST_BLOCKS * block_bytes / (1 << 30)),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(loaded, config, **tenancy.engine_hooks()))
    with BackgroundServer(build_app(engine, ServerConfig(track="stable"), served_model_name=MODEL,
                                    tenancy=tenancy)) as server:
        yield server


def client(served: BackgroundServer, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def complete(served: BackgroundServer, tenant: str, prompt: list[int]):
    return client(served, tenant).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0)


def metric(served: BackgroundServer, name: str, **labels: str) -> float:
    text = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEYS['ops']}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name}{labels} not in /metrics")


def test_a_prompt_evicted_from_the_gpu_comes_back_from_the_host_tier_for_its_tenant_only(served):
    g = torch.Generator().manual_seed(7)
    long_prompt, filler = (torch.randint(5, 1000, (n,), generator=g).tolist() for n in (41, 60))
    first = complete(served, "acme", long_prompt)
    complete(served, "acme", filler)  # pushes the long prompt's blocks out of the 24-block GPU cache
    again = complete(served, "acme", long_prompt)
    assert again.choices[0].text == first.choices[0].text
    host_hits = metric(served, "sits_prefix_cache_tier_hits_total", tenant="acme", tier="host")
    assert host_hits >= BLOCK  # the GPU kept the prompt's head, the host tier gave back its tail
    assert again.usage.prompt_tokens_details.cached_tokens >= host_hits
    assert metric(served, "sits_kv_host_blocks_used", tenant="acme") > 0
    assert metric(served, "sits_kv_host_onload_bytes_total") > 0
    other = complete(served, "globex", long_prompt)  # the same tokens, another tenant's salt
    assert other.usage.prompt_tokens_details is None or not other.usage.prompt_tokens_details.cached_tokens
    assert metric(served, "sits_prefix_cache_tier_hits_total", tenant="globex", tier="host") == 0
    assert metric(served, "sits_prefix_cache_cross_tenant_hits_total", tenant="globex") == 0
