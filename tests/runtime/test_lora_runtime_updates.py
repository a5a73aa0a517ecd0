"""Loading and unloading LoRA adapters while serving (`--allow-runtime-lora-updating`), through the real
server, the official `openai` client and httpx for vLLM's two endpoints: a loaded adapter serves at
once and equals its merged weights, /v1/models follows loads and unloads, an adapter loaded under a
re-used name never hits the prefix-cache blocks of the one it replaced, a stream on another adapter
is not disturbed by a load, an adapter with requests in flight refuses to unload (409), bad input is
OpenAI's error JSON, and who may call the endpoints follows --tenants (admin) and --api-key."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sits.runtime import cli
from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.commands.engine_args import lora_config_from_args
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.lora.config import RUNTIME_UPDATING_ENV, LoraConfig
from sits.runtime.models.loading import load_model
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.server.security import ServerSecurity
from sits.runtime.server.tenant import ApiKeyResolver
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.service import Tenancy
from tests.runtime.lora_helpers import hf_greedy, merged_hf_model, write_peft_adapter
from tests.support.serving import openai_client, serve_loaded

# More than one 16-token block, so the prompt's first block is cached and could be hit again.
PROMPT = ("The three primary colors are red, yellow and blue; mixing two of them gives the secondary colors, "
          "which painters have named for centuries as")
NEW_TOKENS = 6
LONG_TOKENS = 400  # a stream that is still running while other calls are made


@pytest.fixture(scope="module")
def paths(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime-adapters")
    return {"a": write_peft_adapter(root / "a", tiny.config, rank=8, alpha=16, seed=31),
            "b": write_peft_adapter(root / "b", tiny.config, rank=4, alpha=8, seed=32, targets=("q_proj", "v_proj")),
            "c": write_peft_adapter(root / "c", tiny.config, rank=8, alpha=16, seed=33, targets=("down_proj",)),
            "wide": write_peft_adapter(root / "wide", tiny.config, rank=16, alpha=16, seed=34)}


@pytest.fixture(scope="module")
def references(tiny, tiny_llama_dir, paths) -> dict[str, list[int]]:
    """Greedy tokens of PROMPT with each adapter merged into the weights (transformers)."""
    prompt_ids = tiny.tokenizer.encode(PROMPT)
    found = {name: hf_greedy(merged_hf_model(tiny_llama_dir, paths[name]), prompt_ids, NEW_TOKENS)[0]
             for name in ("a", "b")}
    assert found["a"] != found["b"]
    return found


def adapter_roots(paths: dict[str, Path]) -> ServerSecurity:
    """The server may load the adapters of `paths` (--lora-root on their directory)."""
    return ServerSecurity(lora_roots=(paths["a"].parent.resolve(),))


@pytest.fixture(scope="module")
def served(tiny, paths) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    """No adapter at start, two slots, rank up to 8."""
    lora = LoraConfig(enable_lora=True, max_loras=2, max_lora_rank=8, allow_runtime_updating=True)
    with serve_loaded(tiny, num_blocks=96, max_num_seqs=8, max_num_batched_tokens=256, lora=lora,
                      security=adapter_roots(paths)) as served:
        yield served


def load(server: BackgroundServer, name: str, path: Path | str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=60)


def unload(server: BackgroundServer, name: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)


def complete(client: openai.OpenAI, model: str, tokens: int = NEW_TOKENS) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                       extra_body={"min_tokens": tokens})
    assert answer.model == model
    return answer.choices[0].text


def model_ids(client: openai.OpenAI) -> list[str]:
    return [card.id for card in client.models.list().data]


def test_a_loaded_adapter_serves_at_once_and_unloads(served, paths, references, tiny):
    server, engine = served
    client = openai_client(server)
    assert model_ids(client) == [engine.model_name]
    answer = load(server, "sql", paths["a"])
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'sql' added successfully."
    assert model_ids(client) == [engine.model_name, "sql"]
    assert client.models.retrieve("sql").root == "sql"  # its name: /v1/models shows no server path
    assert complete(client, "sql") == tiny.tokenizer.decode(references["a"])
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'sits_lora_adapters_loaded{model="' in metrics and "sits_lora_slots{" in metrics
    assert [line for line in metrics.splitlines() if line.startswith("sits_lora_adapters_loaded{")][0].endswith(" 1.0")

    answer = unload(server, "sql")
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'sql' removed successfully."
    assert model_ids(client) == [engine.model_name]
    with pytest.raises(openai.NotFoundError) as gone:
        complete(client, "sql")
    assert gone.value.body["code"] == "model_not_found"
    again = unload(server, "sql")
    assert again.status_code == 404 and again.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."


def test_a_new_adapter_under_a_reused_name_never_hits_the_old_ones_cache(served, paths, references, tiny):
    server, engine = served
    client = openai_client(server)
    assert load(server, "reused", paths["a"]).status_code == 200
    assert complete(client, "reused") == tiny.tokenizer.decode(references["a"])
    assert unload(server, "reused").status_code == 200
    assert load(server, "reused", paths["b"]).status_code == 200  # the same name, and the same (freed) slot
    hits_before = engine.stats().prefix_cache_hits
    assert complete(client, "reused") == tiny.tokenizer.decode(references["b"])
    assert complete(client, "reused") == tiny.tokenizer.decode(references["b"])  # its own blocks do hit
    assert engine.stats().prefix_cache_hits > hits_before
    assert unload(server, "reused").status_code == 200


def test_slots_run_out_and_bad_adapters_are_400s(served, paths):
    server, engine = served
    cases = [("missing", "/no/such/adapter", "--lora-root"),
             ("wide", str(paths["wide"]), "--max-lora-rank"),
             (engine.model_name, str(paths["a"]), "base model")]
    for name, path, needle in cases:
        answer = load(server, name, path)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert needle in error["message"] and error["type"] == "invalid_request_error"
    assert load(server, "one", paths["a"]).status_code == 200
    twice = load(server, "one", paths["b"])
    assert twice.status_code == 400 and "already been loaded" in twice.json()["error"]["message"]
    assert load(server, "two", paths["c"]).status_code == 200
    full = load(server, "three", paths["b"])
    assert full.status_code == 400 and "--max-loras" in full.json()["error"]["message"]
    missing = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    for name in ("one", "two"):
        assert unload(server, name).status_code == 200
    assert load(server, "three", paths["b"]).status_code == 200  # a freed slot is reusable
    assert unload(server, "three").status_code == 200


def test_a_load_does_not_disturb_a_stream_and_a_busy_adapter_refuses_to_unload(served, paths, tiny,
                                                                             tiny_llama_dir):
    server, engine = served
    client = openai_client(server)
    assert load(server, "streamer", paths["a"]).status_code == 200
    expected, _ = hf_greedy(merged_hf_model(tiny_llama_dir, paths["a"]), tiny.tokenizer.encode(PROMPT), 32)
    stream = client.completions.create(model="streamer", prompt=PROMPT, max_tokens=32, temperature=0,
                                       extra_body={"min_tokens": 32}, stream=True)
    chunks = [next(stream)]
    assert load(server, "newcomer", paths["b"]).status_code == 200  # between two of the stream's steps
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tiny.tokenizer.decode(expected)

    # Each forward takes at least 5 ms from here on, so the long stream (>= 2 s) is surely in flight
    # when the unload arrives, however fast or loaded the machine.
    pace = tiny.model.model.embed_tokens.register_forward_pre_hook(lambda *_: time.sleep(0.005))
    try:
        long = client.completions.create(model="newcomer", prompt=PROMPT, max_tokens=LONG_TOKENS, temperature=0,
                                         extra_body={"min_tokens": LONG_TOKENS}, stream=True)
        next(long)
        busy = unload(server, "newcomer")
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == "adapter_in_use"
        assert "newcomer" in model_ids(client)  # still served
        long.response.close()  # the client leaves: the request is aborted
    finally:
        pace.remove()
    deadline = time.monotonic() + 30
    while (answer := unload(server, "newcomer")).status_code == 409 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert answer.status_code == 200
    assert unload(server, "streamer").status_code == 200


@pytest.mark.parametrize("argv", [["--allow-runtime-lora-updating"],
                                  ["--allow-runtime-lora-updating", "--lora-modules", "a=/x"]],
                         ids=["alone", "with-modules"])
def test_the_flag_needs_enable_lora(argv, capsys):
    code = cli.main(["serve", "--device", "cpu", "--port", "0", "--log-level", "error", *argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert "--enable-lora" in lines[0]


def test_the_environment_variable_counts_with_enable_lora(monkeypatch):
    import argparse

    from sits.runtime.commands.engine_args import add_lora_arguments

    parser = argparse.ArgumentParser()
    add_lora_arguments(parser)
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "1")
    assert lora_config_from_args(parser.parse_args(["--enable-lora", "--max-loras", "3"])).allow_runtime_updating
    assert not lora_config_from_args(parser.parse_args([])).allow_runtime_updating
    monkeypatch.delenv(RUNTIME_UPDATING_ENV)
    assert not lora_config_from_args(parser.parse_args(["--enable-lora"])).allow_runtime_updating


# The servers below run over a model of their own: a new engine over `tiny` would take the hooks of
# the module's server off it.
@pytest.fixture(scope="module")
def own_tiny(tiny_llama_dir):
    return load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"), TorchAttentionBackend(),
                      progress=False)


def test_without_the_flag_the_endpoints_do_not_exist(own_tiny, paths):
    with serve_loaded(own_tiny, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=128,
                      lora=LoraConfig(enable_lora=True)) as (server, _):
        for answer in (load(server, "a", paths["a"]), unload(server, "a")):
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_url"
        assert "sits_lora_adapters_loaded" not in httpx.get(f"{server.url}/metrics").text


@pytest.fixture
def tenant_server(own_tiny, tmp_path, paths) -> Iterator[tuple[BackgroundServer, str]]:
    path = tmp_path / "tenants.yaml"
    path.write_text('tenants:\n  - {name: ops, apiKey: "sk-ops", admin: true}\n'
                    '  - {name: app, apiKey: "sk-app", models: [tiny-base]}\n'
                    '  - {name: lab, apiKey: "sk-lab", admin: false}\n')
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(path)))
    config = EngineConfig(model=ModelConfig(device="cpu"), cache=CacheConfig(num_blocks=32),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
                          lora=LoraConfig(enable_lora=True, max_loras=1, allow_runtime_updating=True))
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(own_tiny, config, **tenancy.engine_hooks()))
    try:
        with BackgroundServer(build_app(engine, ServerConfig(), served_model_name="tiny-base",
                                        tenancy=tenancy, security=adapter_roots(paths))) as server:
            yield server, "tiny-base"
    finally:
        engine.engine.lora.detach()


def test_with_tenants_only_an_admin_may_change_adapters(tenant_server, paths):
    server, base = tenant_server
    for key in ("sk-app", "sk-lab"):
        for answer in (load(server, "ops-a", paths["a"], key), unload(server, "ops-a", key)):
            assert answer.status_code == 403, answer.text
            assert answer.json()["error"]["code"] == "permission_denied"
    assert load(server, "ops-a", paths["a"]).status_code == 401  # no key at all
    assert load(server, "ops-a", paths["a"], "sk-ops").status_code == 200
    ops = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-ops", max_retries=0, timeout=60)
    app = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-app", max_retries=0, timeout=60)
    assert model_ids(ops) == [base, "ops-a"]
    assert model_ids(app) == [base]  # its models list lacks the new adapter: it does not exist to it
    with pytest.raises(openai.NotFoundError):
        complete(app, "ops-a")
    complete(ops, "ops-a")
    assert unload(server, "ops-a", "sk-ops").status_code == 200


def test_with_an_api_key_the_key_is_required(own_tiny, paths):
    config = EngineConfig(model=ModelConfig(device="cpu"), cache=CacheConfig(num_blocks=32),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
                          lora=LoraConfig(enable_lora=True, max_loras=1, allow_runtime_updating=True))
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(own_tiny, config))
    try:
        with BackgroundServer(build_app(engine, ServerConfig(), tenant_resolver=ApiKeyResolver(["sk-key"]),
                                        security=adapter_roots(paths))) as server:
            refused = load(server, "k", paths["a"])
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_request_error"
            assert load(server, "k", paths["a"], "wrong").status_code == 401
            assert load(server, "k", paths["a"], "sk-key").status_code == 200
            assert unload(server, "k").status_code == 401
            assert unload(server, "k", "sk-key").status_code == 200
    finally:
        engine.engine.lora.detach()


def test_the_admin_flag_of_a_tenant_parses_and_survives_the_state_store():
    from sits.runtime.tenancy.tenants import TenantConfigError, parse_tenants

    table = parse_tenants({"tenants": [{"name": "ops", "apiKey": "k1", "admin": True}, {"name": "app", "apiKey": "k2"}]})
    assert (table.get("ops").admin, table.get("app").admin) == (True, False)
    again = parse_tenants(table.to_document())
    assert (again.get("ops").admin, again.get("app").admin) == (True, False)
    with pytest.raises(TenantConfigError, match='tenant "ops": admin must be true or false'):
        parse_tenants({"tenants": [{"name": "ops", "apiKey": "k1", "admin": "yes"}]})
