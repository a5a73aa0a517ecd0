"""Per-tenant model allow-lists through the real server (uvicorn, the tiny random Llama with a LoRA
adapter, the tenant table in a real Redis) and the official openai client: a model kept from a
tenant is the 404 of a model that does not exist on every route (streamed too, before any stream),
/v1/models lists only the tenant's models, a new list written to the stored table applies after
the next poll, and 401 comes before 404."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.lora.config import LoraConfig, LoraModule
from sits.runtime.models.loading import load_model
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.service import Tenancy
from sits.runtime.tenancy.state_store import open_state_store
from tests.runtime.lora_helpers import hf_greedy, merged_hf_model, write_peft_adapter

BASE, ADAPTER = "tiny-llama", "adapter-a"
ALPHA_KEY, BETA_KEY, GAMMA_KEY = "sk-alpha-5be1", "sk-beta-0d7c", "sk-gamma-93aa"
TENANTS_YAML = f"""
tenants:
  - {{name: alpha, apiKey: "{ALPHA_KEY}", kvCacheShare: 0.3, models: [{BASE}, {ADAPTER}]}}
  - {{name: beta, apiKey: "{BETA_KEY}", kvCacheShare: 0.3, models: [{BASE}]}}
  - {{name: gamma, apiKey: "{GAMMA_KEY}"}}
  - {{name: delta, apiKey: "sk-delta-77f0", models: [{BASE}, adapter-retired]}}
"""
PROMPT = "The three primary colors are"
NEW_TOKENS = 4
MESSAGES = [{"role": "user", "content": "Name a color."}]
POLL_S = 0.1


class Records(logging.Handler):
    """Keeps the records logged while it is attached (the module's server starts outside any test)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    config = ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256)
    return load_model(config, TorchAttentionBackend(), progress=False)


@pytest.fixture(scope="module")
def adapter_dir(tiny, tmp_path_factory):
    return write_peft_adapter(tmp_path_factory.mktemp("tenant-adapters") / ADAPTER, tiny.config, seed=21)


@pytest.fixture(scope="module")
def served(tiny, adapter_dir, redis_service, tmp_path_factory) -> Iterator[tuple[BackgroundServer, Tenancy, Records]]:
    """The server as `sits serve --tenants ... --state-store redis://... --enable-lora --lora-modules` builds it."""
    path = tmp_path_factory.mktemp("tenant-models") / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    tenancy = Tenancy.from_config(TenancyConfig(
        tenants_file=str(path), state_store=f"redis://127.0.0.1:{redis_service.port}/0",
        deployment=f"models-{uuid.uuid4().hex[:8]}", tenant_poll_interval_s=POLL_S))
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=256),
                          cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
                          lora=LoraConfig(enable_lora=True, modules=[LoraModule(ADAPTER, str(adapter_dir))]))
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(tiny, config, **tenancy.engine_hooks()))
    warnings = Records()
    logging.getLogger("sits.runtime.tenancy").addHandler(warnings)
    try:
        app = build_app(engine, ServerConfig(track="stable"), served_model_name=BASE, tenancy=tenancy)
    finally:
        logging.getLogger("sits.runtime.tenancy").removeHandler(warnings)
    try:
        with BackgroundServer(app) as server:
            yield server, tenancy, warnings
    finally:
        engine.engine.lora.detach()


def client_for(server: BackgroundServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def refusals(client: openai.OpenAI, model: str) -> list[dict]:
    """The error bodies of every route asked for `model`: completions and chat, whole and streamed."""
    calls = [lambda stream: client.completions.create(model=model, prompt="hi", max_tokens=2, stream=stream),
             lambda stream: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                                           stream=stream)]
    bodies = []
    for call in calls:
        for stream in (False, True):
            with pytest.raises(openai.NotFoundError) as refused:
                call(stream)  # streamed: the 404 is the response itself, no event stream starts
            assert refused.value.response.headers["content-type"] == "application/json"
            bodies.append(refused.value.body)
    return bodies


def test_a_model_kept_from_a_tenant_is_the_404_of_a_model_that_does_not_exist(served):
    server, _, _ = served
    beta = client_for(server, BETA_KEY)
    kept = refusals(beta, ADAPTER)
    assert kept[0] == {"message": f"The model `{ADAPTER}` does not exist or you do not have access to it.",
                       "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert kept == [kept[0]] * 4
    missing = refusals(beta, "adapter-z")  # not served at all: the very same answer but for the name
    assert [b | {"message": b["message"].replace("adapter-z", ADAPTER)} for b in missing] == kept
    with pytest.raises(openai.NotFoundError) as retrieved:
        beta.models.retrieve(ADAPTER)
    assert retrieved.value.body == kept[0]
    for route, body in (("tokenize", {"prompt": "hi"}), ("detokenize", {"tokens": [1, 2]})):
        answer = httpx.post(f"{server.url}/{route}", json={"model": ADAPTER, **body},
                            headers={"Authorization": f"Bearer {BETA_KEY}"})
        assert (answer.status_code, answer.json()["error"]) == (404, kept[0])
        mine = httpx.post(f"{server.url}/{route}", json={"model": BASE, **body},
                          headers={"Authorization": f"Bearer {BETA_KEY}"})
        assert mine.status_code == 200
    assert beta.completions.create(model=BASE, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_a_tenant_allowed_the_adapter_gets_its_completions(served, tiny, adapter_dir, tiny_llama_dir):
    server, _, _ = served
    prompt_ids = tiny.tokenizer.encode(PROMPT)
    expected, _ = hf_greedy(merged_hf_model(tiny_llama_dir, adapter_dir), prompt_ids, NEW_TOKENS)
    for key in (ALPHA_KEY, GAMMA_KEY):  # gamma has no list: every served model
        client = client_for(server, key)
        answer = client.completions.create(model=ADAPTER, prompt=prompt_ids, max_tokens=NEW_TOKENS, temperature=0,
                                           extra_body={"min_tokens": NEW_TOKENS})
        assert answer.model == ADAPTER and answer.choices[0].text == tiny.tokenizer.decode(expected)
    alpha = client_for(server, ALPHA_KEY)
    whole = alpha.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0)
    chunks = list(alpha.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                                temperature=0, stream=True))
    assert {chunk.model for chunk in chunks} == {ADAPTER}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": ADAPTER, "prompt": PROMPT},
                           headers={"Authorization": f"Bearer {ALPHA_KEY}"})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == prompt_ids


def test_models_lists_only_the_tenants_models(served):
    server, _, _ = served
    listed = {key: [card.id for card in client_for(server, key).models.list().data]
              for key in (ALPHA_KEY, BETA_KEY, GAMMA_KEY)}
    assert listed == {ALPHA_KEY: [BASE, ADAPTER], BETA_KEY: [BASE], GAMMA_KEY: [BASE, ADAPTER]}
    card = client_for(server, ALPHA_KEY).models.retrieve(ADAPTER)
    assert (card.id, card.parent) == (ADAPTER, BASE)
    assert client_for(server, BETA_KEY).models.retrieve(BASE).id == BASE


def test_no_key_or_a_wrong_key_is_401_before_the_model_is_looked_at(served):
    server, _, _ = served
    body = {"model": ADAPTER, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer sk-nobody"}):
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers=headers).status_code == 401
        assert httpx.get(f"{server.url}/v1/models/{ADAPTER}", headers=headers).status_code == 401
        assert httpx.post(f"{server.url}/tokenize", json={"model": ADAPTER, "prompt": "hi"},
                          headers=headers).status_code == 401


def test_a_listed_model_the_server_does_not_serve_is_a_startup_warning(served):
    server, _, warnings = served
    messages = [record.getMessage() for record in warnings.records]
    assert [m for m in messages if "does not serve" in m] == [
        f"tenant delta lists model(s) adapter-retired, which this server does not serve (serving: {ADAPTER}, {BASE})"]
    delta = client_for(server, "sk-delta-77f0")
    assert [card.id for card in delta.models.list().data] == [BASE]  # only what is both listed and served
    with pytest.raises(openai.NotFoundError):
        delta.completions.create(model="adapter-retired", prompt="hi", max_tokens=1)


async def write_table(url: str, deployment: str, document: dict) -> int:
    store = open_state_store(url, deployment=deployment)
    await store.start()
    try:
        return await store.put_tenant_table(document)
    finally:
        await store.close()


def test_a_new_list_in_the_stored_table_applies_after_the_poll_without_a_restart(served, redis_service, caplog):
    server, tenancy, _ = served
    url = f"redis://127.0.0.1:{redis_service.port}/0"
    original = tenancy.table.to_document()  # digests only: what an operator writes
    swapped = copy.deepcopy(original)
    for tenant in swapped["tenants"]:
        if tenant["name"] == "alpha":
            tenant["models"] = [BASE]
        if tenant["name"] == "beta":
            tenant["models"] = [BASE, ADAPTER, "adapter-next"]
    alpha, beta = client_for(server, ALPHA_KEY), client_for(server, BETA_KEY)
    caplog.set_level(logging.WARNING, logger="sits.runtime.tenancy.service")
    try:
        asyncio.run(write_table(url, tenancy.config.deployment, swapped))
        deadline = time.monotonic() + 10
        while [m.id for m in beta.models.list().data] != [BASE, ADAPTER] and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
        assert [m.id for m in beta.models.list().data] == [BASE, ADAPTER]
        assert beta.completions.create(model=ADAPTER, prompt="hi", max_tokens=2).model == ADAPTER
        assert refusals(alpha, ADAPTER)[0]["code"] == "model_not_found"
        assert [m.id for m in alpha.models.list().data] == [BASE]
        assert any("tenant beta lists model(s) adapter-next" in r.getMessage() for r in caplog.records)
    finally:
        asyncio.run(write_table(url, tenancy.config.deployment, original))
        deadline = time.monotonic() + 10
        while [m.id for m in alpha.models.list().data] != [BASE, ADAPTER] and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
    assert [m.id for m in beta.models.list().data] == [BASE]
