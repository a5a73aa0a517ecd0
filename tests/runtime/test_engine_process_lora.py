"""Runtime LoRA updates through `sits serve` with the engine in its own process: the adapter is read
and written into a slot by the engine process, its outputs match transformers with the adapter
merged, and unloading it makes its model id a 404 again."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.runtime.lora_helpers import hf_greedy, merged_hf_model, write_peft_adapter
from tests.support.services import RunningService, free_port, started

PROMPT = "The three primary colors are red, yellow and blue; mixing two of them gives"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory) -> Path:
    return write_peft_adapter(tmp_path_factory.mktemp("adapters") / "a", tiny.config, rank=8, alpha=16, seed=31)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapter) -> Iterator[RunningService]:
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--dtype", "float32", "--port", str(port), "--num-blocks", "64", "--max-model-len", "256",
            "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
            "--lora-root", str(adapter.parent), "--log-level", "info"]
    with started(argv, port, timeout_s=180, log_name="serve.log") as service:
        yield service


def complete(service: RunningService, model: str) -> str:
    client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                     extra_body={"min_tokens": NEW_TOKENS}).choices[0].text


def model_ids(service: RunningService) -> list[str]:
    return [card["id"] for card in httpx.get(f"{service.url}/v1/models", timeout=30).json()["data"]]


def test_an_adapter_loads_into_the_engine_process_serves_and_unloads(server, adapter, tiny, tiny_llama_dir):
    base = model_ids(server)[0]
    reference, _ = hf_greedy(merged_hf_model(tiny_llama_dir, adapter), tiny.tokenizer.encode(PROMPT), NEW_TOKENS)
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)},
                        timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert model_ids(server) == [base, "a"]
    assert complete(server, "a") == tiny.tokenizer.decode(reference)
    assert complete(server, base) != complete(server, "a")

    full = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapter)},
                      timeout=60)
    assert full.status_code == 400 and full.json()["error"]["code"] == "no_free_lora_slot"

    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert model_ids(server) == [base]
    gone = httpx.post(f"{server.url}/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 2},
                      timeout=60)
    assert gone.status_code == 404


def test_an_adapter_the_engine_cannot_read_is_a_400(server, adapter):
    empty = adapter.parent / "not-an-adapter"  # under the --lora-root, so the engine process tries to read it
    empty.mkdir(exist_ok=True)
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(empty)},
                     timeout=60)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "lora_path"
    assert "x" not in model_ids(server)
