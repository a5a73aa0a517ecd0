"""What standard clients expect and found missing: GET /tokenizer_info (lm-eval's remote tokenizer),
`stream_options.continuous_usage_stats` (usage in every chunk, as vLLM sends it) and a Retry-After
within the rate-limit window. Through a real server (a tiny random Llama with SmolLM2's tokenizer),
the official openai client and httpx; lm-evaluation-harness itself, when installed, against that
server from a process with no Hub access.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.models.loading import load_model
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.rate_windows import WINDOW_S
from sits.runtime.tenancy.service import Tenancy

KEY, ONCE_KEY = "sk-gaps-0a1b2c", "sk-once-3d4e5f"
TENANTS_YAML = f"""
tenants:
  - {{name: team, apiKey: "{KEY}"}}
  - {{name: once, apiKeySha256: "{hashlib.sha256(ONCE_KEY.encode()).hexdigest()}", requestsPerMinute: 1}}
"""
MODEL, MAX_MODEL_LEN = "tiny-llama", 256


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory) -> Iterator[BackgroundServer]:
    tenants = tmp_path_factory.mktemp("gaps") / "tenants.yaml"
    tenants.write_text(TENANTS_YAML)
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(tenants)))
    loaded = load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                    max_model_len=MAX_MODEL_LEN), TorchAttentionBackend(), progress=False)
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(loaded, config, **tenancy.engine_hooks()))
    with BackgroundServer(build_app(engine, ServerConfig(track="stable"), served_model_name=MODEL,
                                    tenancy=tenancy)) as server:
        yield server


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=60)


# -- GET /tokenizer_info -----------------------------------------------------------------------------

def test_tokenizer_info_describes_the_served_tokenizer_as_vllm_does(served):
    assert httpx.get(f"{served.url}/tokenizer_info").status_code == 401  # with tenants, a key as for /tokenize
    response = httpx.get(f"{served.url}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    info = response.json()
    tokenizer = served.app.state.ctx.tokenizer
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == ("<|im_start|>", "<|im_end|>")  # SmolLM2's
    assert {"unk_token", "pad_token"} <= set(info) and info["model_max_length"] == MAX_MODEL_LEN
    assert info["chat_template"] == tokenizer.chat_template
    # what lm-eval's RemoteTokenizer does with it: encode the eos string through /tokenize -> its id
    tokens = httpx.post(f"{served.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                        json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert tokens == [tokenizer.eos_token_id]


# -- stream_options.continuous_usage_stats -------------------------------------------------------------

def check_running_usage(chunks: list, prompt_tokens: int) -> None:
    """Every chunk with a choice carries that choice's usage so far; it never goes down."""
    counted = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert counted and all(chunk.usage is not None for chunk in chunks)
    assert all(chunk.usage.prompt_tokens == prompt_tokens for chunk in chunks if chunk.choices)
    assert all(chunk.usage.total_tokens == prompt_tokens + chunk.usage.completion_tokens for chunk in chunks)
    assert counted == sorted(counted) and counted[-1] == chunks[-1].usage.completion_tokens


def test_continuous_usage_stats_put_usage_in_every_completion_chunk(client):
    stream = client.completions.create(model=MODEL, prompt="The lighthouse keeper", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 6  # include_usage's summary, as before
    check_running_usage(chunks, final.usage.prompt_tokens)
    assert [c.usage.completion_tokens for c in chunks if c.choices][-1] == 6
    plain = list(client.completions.create(model=MODEL, prompt="The lighthouse keeper", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(chunk.usage is None for chunk in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_continuous_usage_stats_put_usage_in_every_chat_chunk(client):
    messages = [{"role": "user", "content": "Say something about the sea."}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True, n=2,
        stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert all(chunk.choices for chunk in chunks)  # no include_usage: no usage-only chunk at the end
    prompt_tokens = chunks[0].usage.prompt_tokens
    for index in (0, 1):  # each choice counts its own tokens
        mine = [chunk for chunk in chunks if chunk.choices[0].index == index]
        assert mine[0].choices[0].delta.role == "assistant" and mine[0].usage.completion_tokens == 0
        check_running_usage(mine, prompt_tokens)
        assert mine[-1].choices[0].finish_reason == "length" and mine[-1].usage.completion_tokens == 5


# -- Retry-After ---------------------------------------------------------------------------------------

def test_retry_after_never_exceeds_the_rate_limit_window(served):
    limited = openai.OpenAI(base_url=f"{served.url}/v1", api_key=ONCE_KEY, max_retries=0, timeout=60)
    limited.completions.create(model=MODEL, prompt="one", max_tokens=1)
    # 1 request per minute: the sliding estimate stays full until the end of the next window
    # (up to 120 s away); a Retry-After above the window is refused advice (OpenAI's client ignores it)
    with pytest.raises(openai.RateLimitError) as refused:
        limited.completions.create(model=MODEL, prompt="two", max_tokens=1)
    retry_after = int(refused.value.response.headers["retry-after"])
    assert 1 <= retry_after <= WINDOW_S
    assert f"Please try again in {retry_after}s." in refused.value.message


# -- lm-evaluation-harness against `sits serve` ---------------------------------------------------------

TASK_YAML = """
task: sits_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [{"question": "The sky is", "choices": [" blue", " green"], "answer": 0},
        {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
        {"question": "Water is", "choices": [" wet", " dry"], "answer": 0}]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-evaluation-harness is not installed")
def test_lm_eval_local_completions_uses_the_remote_tokenizer_offline(served, tmp_path):
    """lm-eval, with no Hub access, against this module's server (the app `sits serve` builds, over HTTP)."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "task.yaml").write_text(TASK_YAML.format(data=tmp_path / "data.jsonl"))
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", "OPENAI_API_KEY": KEY}
    # the key: OPENAI_API_KEY for the completions, auth_token for the tokenizer routes (the server has tenants)
    model_args = (f"base_url={served.url}/v1/completions,model={MODEL},num_concurrent=1,auth_token={KEY},"
                  "max_retries=1,tokenized_requests=True")  # tokenizer_backend: the default, auto
    done = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
                           "--model_args", model_args, "--tasks", "sits_tiny_choice",
                           "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, **offline})
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "Auto-detected remote tokenizer support" in log and "Using remote tokenizer" in log, log[-4000:]
    (results_file,) = Path(tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]["sits_tiny_choice"]
    assert 0.0 <= results["acc,none"] <= 1.0  # a random model: the score means nothing, the run everything
