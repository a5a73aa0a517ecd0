"""vLLM's /tokenize, /detokenize and /version through a real uvicorn server (SmolLM2-135M-Instruct) and httpx.

The prompt form is compared with the served tokenizer, the chat form with transformers' rendering
of SmolLM2's chat template and with the prompt a real /v1/chat/completions call counts; with
tenants the utility endpoints need a key but never use up a tenant's rate limit.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator

import httpx
import pytest

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.server.serving import TOKENIZE_INLINE_CHARS
from sits.runtime.server.tokenize import DECODE_INLINE_TOKENS
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.service import Tenancy

CONVERSATION = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy? ¿Qué? 🙂"}]
TEXT = "The three primary colors are red, yellow and blue. Ünïcödé ✓ 🙂\n\tTabs too."
KEY = "sk-tokenize-5e1a77"
MAX_MODEL_LEN = 1024  # the utility endpoints need no long context; a small KV cache keeps set-up quick


def engine_for(smollm2, **hooks) -> AsyncEngine:
    config = EngineConfig(model=ModelConfig(device="cpu", max_model_len=MAX_MODEL_LEN), cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    return AsyncEngine.from_engine(LLMEngine.from_loaded(smollm2, config, **hooks))


@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[BackgroundServer]:
    with BackgroundServer(build_app(engine_for(smollm2))) as server:
        yield server


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def ctx(served):
    """The server's serving context: its tokenizer, model name and limits."""
    return served.app.state.ctx


def tokenize(http: httpx.Client, **body) -> dict:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_a_prompt_gives_the_tokenizers_ids(http, ctx):
    expected = ctx.tokenizer.encode(TEXT, add_special_tokens=True)
    answer = tokenize(http, model=ctx.model_name, prompt=TEXT)
    assert answer == {"count": len(expected), "max_model_len": ctx.max_model_len, "tokens": expected}
    without_special = tokenize(http, prompt=TEXT, add_special_tokens=False)
    assert without_special["tokens"] == ctx.tokenizer.encode(TEXT, add_special_tokens=False)
    spelled = tokenize(http, prompt=TEXT, return_token_strs=True)
    assert spelled["tokens"] == expected
    assert spelled["token_strs"] == [ctx.tokenizer.id_to_token(token_id) for token_id in expected]
    assert tokenize(http, prompt="")["count"] == len(ctx.tokenizer.encode("", add_special_tokens=True))


def test_tokenize_messages_gives_the_prompt_a_chat_completion_runs(http, ctx, hf_smollm2_tokenizer):
    answer = tokenize(http, messages=CONVERSATION)
    rendered = hf_smollm2_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == hf_smollm2_tokenizer.encode(rendered, add_special_tokens=False)
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == ctx.max_model_len

    completion = http.post("/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 1, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == answer["count"]

    no_generation_prompt = tokenize(http, messages=CONVERSATION, add_generation_prompt=False)
    rendered_without = hf_smollm2_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False,
                                                                tokenize=False)
    assert no_generation_prompt["tokens"] == hf_smollm2_tokenizer.encode(rendered_without, add_special_tokens=False)
    assert no_generation_prompt["count"] < answer["count"]


def test_detokenize_round_trips_prompts_and_rendered_chats(http, hf_smollm2_tokenizer):
    tokens = tokenize(http, prompt=TEXT, add_special_tokens=False)["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": TEXT}
    # Special tokens stay in the text: a rendered chat comes back as the template wrote it.
    chat_tokens = tokenize(http, messages=CONVERSATION)["tokens"]
    rendered = hf_smollm2_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert http.post("/detokenize", json={"tokens": chat_tokens}).json() == {"prompt": rendered}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_long_inputs_are_tokenized_and_decoded_whole(http, ctx):
    """Past the inline limits the work runs in a worker thread; the answer is the same."""
    long_text = (TEXT + " ") * (TOKENIZE_INLINE_CHARS // len(TEXT) + 1)
    assert len(long_text) > TOKENIZE_INLINE_CHARS
    tokens = tokenize(http, prompt=long_text, add_special_tokens=False)["tokens"]
    assert tokens == ctx.tokenizer.encode(long_text, add_special_tokens=False)
    assert len(tokens) > DECODE_INLINE_TOKENS
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": long_text}


def test_version_is_the_installed_package_version(http):
    response = http.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": importlib.metadata.version("sits")}


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tokenize_with_tools_gives_the_prompt_the_chat_route_runs_with_them(http):
    """Tools reach the chat template on both routes alike (SmolLM2's template leaves them out)."""
    answer = tokenize(http, messages=CONVERSATION, tools=[WEATHER_TOOL])
    completion = http.post("/v1/chat/completions", json={"messages": CONVERSATION, "tools": [WEATHER_TOOL],
                                                         "tool_choice": "none", "max_tokens": 1, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["prompt_tokens"] == answer["count"]


def bad_input_cases(ctx) -> list[tuple[str, str, object, int, str | None]]:
    """(path, case id, JSON body or raw bytes, expected status, expected param)."""
    vocab_size = ctx.tokenizer.vocab_size
    too_long = "x" * (ctx.max_prompt_chars + 1)
    return [
        ("/tokenize", "unknown-model", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
        ("/tokenize", "empty-body", b"", 400, None),
        ("/tokenize", "empty-object", {}, 400, "prompt"),
        ("/tokenize", "not-json", b'{"prompt": ', 400, None),
        ("/tokenize", "prompt-a-number", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", "prompt-token-ids", {"prompt": [1, 2]}, 400, "prompt"),
        ("/tokenize", "prompt-and-messages", {"prompt": "hi", "messages": CONVERSATION}, 400, "messages"),
        ("/tokenize", "messages-empty", {"messages": []}, 400, "messages"),
        ("/tokenize", "role-unknown", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ("/tokenize", "special-tokens-a-string", {"prompt": "hi", "add_special_tokens": "yes"}, 400,
         "add_special_tokens"),
        ("/tokenize", "continue-and-generation-prompt", {"messages": CONVERSATION, "add_generation_prompt": True,
                                                         "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", "reserved-template-variable", {"messages": CONVERSATION, "chat_template_kwargs": {"tools": []}},
         400, "chat_template_kwargs"),
        ("/tokenize", "tools-sharing-a-name", {"messages": CONVERSATION, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, 400,
         "tools"),
        ("/tokenize", "tool-without-a-function", {"messages": CONVERSATION, "tools": [{"type": "function"}]}, 400,
         "tools"),
        ("/tokenize", "lone-surrogate", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
        ("/tokenize", "longer-than-any-context", {"prompt": too_long}, 400, "prompt"),
        ("/detokenize", "unknown-model", {"model": "no-such-model", "tokens": [1]}, 404, "model"),
        ("/detokenize", "empty-object", {}, 400, "tokens"),
        ("/detokenize", "id-past-the-vocabulary", {"tokens": [1, vocab_size]}, 400, "tokens[1]"),
        ("/detokenize", "negative-id", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", "huge-id", {"tokens": [2**70]}, 400, "tokens[0]"),
        ("/detokenize", "tokens-a-string", {"tokens": "1 2 3"}, 400, "tokens"),
        ("/detokenize", "id-a-float", {"tokens": [1.5]}, 400, "tokens[0]"),
        ("/detokenize", "id-a-bool", {"tokens": [True]}, 400, "tokens[0]"),
    ]


def test_bad_input_gets_its_4xx_in_openais_error_shape(http, ctx):
    for path, case, body, status, param in bad_input_cases(ctx):
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = http.post(path, json=body)
        assert response.status_code == status, (path, case, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (path, case)
        assert error["type"] == "invalid_request_error" and error["message"], (path, case)
        assert error["param"] == param, (path, case, error)
    assert http.get("/tokenize").status_code == 405
    assert http.get("/health").status_code == 200  # still serving


TENANTS_YAML = f"""
tenants:
  - {{name: tokenizer-user, apiKey: "{KEY}", requestsPerMinute: 1}}
"""


@pytest.fixture(scope="module")
def tenant_server(smollm2, tmp_path_factory) -> Iterator[BackgroundServer]:
    tenants_file = tmp_path_factory.mktemp("tokenize-tenants") / "tenants.yaml"
    tenants_file.write_text(TENANTS_YAML)
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(tenants_file)))
    engine = engine_for(smollm2, **tenancy.engine_hooks())
    with BackgroundServer(build_app(engine, tenancy=tenancy)) as server:
        yield server


def test_with_tenants_tokenizing_needs_a_key_but_no_rate_limit(tenant_server):
    keyed = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=tenant_server.url, timeout=120) as http:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            missing = http.post(path, json=body)
            assert missing.status_code == 401 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
            wrong = http.post(path, json=body, headers={"Authorization": "Bearer sk-wrong"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            # Authentication comes before the body: a broken body without a key is a 401, with one a 400.
            assert http.post(path, content=b'{"prompt": ').status_code == 401
            assert http.post(path, content=b'{"prompt": ', headers=keyed).status_code == 400
        # Three calls past a one-request-per-minute limit: tokenizing is not a generation request ...
        for _ in range(3):
            assert http.post("/tokenize", json={"prompt": "hi"}, headers=keyed).status_code == 200
            assert http.post("/detokenize", json={"tokens": [1, 2]}, headers=keyed).status_code == 200
        # ... so the tenant's one completion of the minute is still there, and the next is refused.
        completion = {"prompt": "hi", "max_tokens": 1}
        assert http.post("/v1/completions", json=completion, headers=keyed).status_code == 200
        assert http.post("/v1/completions", json=completion, headers=keyed).status_code == 429
        assert http.get("/version").status_code == 200  # version and health stay open
        assert http.get("/health").status_code == 200
