"""Malformed requests get the right 4xx in OpenAI's error shape, and the server stays up.

A tiny random Llama (SmolLM2's tokenizer, max_model_len 128) behind a real uvicorn server: errors
need no real text, only a real engine and tokenizer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer

MAX_MODEL_LEN = 128
MAX_BODY_BYTES = 1024 * 1024
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def served(tiny_llama_dir) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    config = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), device="cpu", max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    engine = AsyncEngine.from_config(config, progress=False)
    with BackgroundServer(build_app(engine, max_body_bytes=MAX_BODY_BYTES)) as server:
        yield server, engine


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0].url, timeout=30) as client:
        yield client


def chat(**fields):
    return {"messages": HELLO, "max_tokens": 2, **fields}


def completion(**fields):
    return {"prompt": "Hello", "max_tokens": 2, **fields}


# (case id, method, path, JSON body or raw bytes, expected status, expected param)
CASES = [
    ("invalid-json", "POST", CHAT, b'{"messages": [', 400, None),
    ("body-not-an-object", "POST", CHAT, b"[1, 2]", 400, None),
    ("messages-missing", "POST", CHAT, {"max_tokens": 2}, 400, "messages"),
    ("messages-empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("role-unknown", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("role-missing", "POST", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("content-a-number", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("content-an-image", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content"),
    ("temperature-too-high", "POST", CHAT, chat(temperature=3.5), 400, "temperature"),
    ("temperature-a-string", "POST", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("max-tokens-negative", "POST", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("max-completion-tokens-zero", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("max-tokens-a-string", "POST", CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    ("n-zero", "POST", CHAT, chat(n=0), 400, "n"),
    ("top-p-zero", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-logprobs-too-many", "POST", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("stream-not-a-bool", "POST", CHAT, chat(stream="yes"), 400, "stream"),
    ("stream-options-without-stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("stop-a-number", "POST", CHAT, chat(stop=5), 400, "stop"),
    ("tools-unsupported", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("model-unknown", "POST", CHAT, chat(model="gpt-17"), 404, "model"),
    ("prompt-missing", "POST", COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    ("prompt-empty-list", "POST", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("prompt-mixed-list", "POST", COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt"),
    ("prompt-token-out-of-vocab", "POST", COMPLETIONS, completion(prompt=[1, 10**7]), 400, "prompt"),
    ("prompt-longer-than-context", "POST", COMPLETIONS, completion(prompt=[5] * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    ("output-beyond-context", "POST", COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("logprobs-too-many", "POST", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("max-tokens-0-without-echo", "POST", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    ("presence-penalty-out-of-range", "POST", COMPLETIONS, completion(presence_penalty=5), 400, "presence_penalty"),
    ("seed-beyond-64-bits", "POST", COMPLETIONS, completion(seed=2**70), 400, "seed"),
    ("min-tokens-above-max", "POST", COMPLETIONS, completion(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("unknown-route", "GET", "/v1/engines", None, 404, None),
    ("wrong-method", "GET", COMPLETIONS, None, 405, None),
    ("wrong-method-on-models", "DELETE", "/v1/models", None, 405, None),
    ("body-too-large", "POST", COMPLETIONS, b'{"prompt": "' + b"a" * (2 * MAX_BODY_BYTES) + b'"}', 413, None),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str) and body["error"]["type"]
    assert body["error"]["param"] == param
    return body["error"]


EXPECTED_CODES = {"invalid-json": "invalid_json", "model-unknown": "model_not_found",
                  "prompt-longer-than-context": "context_length_exceeded",
                  "output-beyond-context": "context_length_exceeded", "unknown-route": "unknown_url"}


@pytest.mark.parametrize(("case", "method", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_an_openai_error(http, case, method, path, body, status, param):
    if isinstance(body, bytes):
        response = http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.request(method, path, json=body)
    error = assert_openai_error(response, status, param)
    if case in EXPECTED_CODES:
        assert error["code"] == EXPECTED_CODES[case]


def test_a_chunked_body_over_the_limit_is_413(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(3):
            yield b"a" * MAX_BODY_BYTES
        yield b'"}'

    response = http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413, None)


def test_a_body_without_json_content_type_is_a_clear_400(http):
    response = http.post(COMPLETIONS, content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    error = assert_openai_error(response, 400, None)
    assert "application/json" in error["message"]


def test_official_client_raises_its_typed_errors(served):
    server, engine = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=engine.model_name, messages=HELLO, temperature=9)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="not-served", prompt="hi")
    assert missing.value.body["code"] == "model_not_found"


def test_server_stays_up_and_counts_the_errors(served, http):
    server, engine = served
    assert http.get("/health").json() == {"status": "ok"}
    ok = http.post(COMPLETIONS, json=completion(model=engine.model_name))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
    metrics = http.get("/metrics").text
    assert 'sits_requests_total{model="' in metrics and 'status="400"' in metrics and 'status="404"' in metrics


def test_a_stopped_engine_gives_503_and_fails_readiness(served, http):
    """Runs last: it shuts the engine down under the running server."""
    server, engine = served
    asyncio.run(engine.shutdown(0.0))
    response = http.post(COMPLETIONS, json=completion())
    error = assert_openai_error(response, 503, None)
    assert response.headers.get("retry-after") and error["type"] == "service_unavailable"
    assert http.get("/health").status_code == 503
    assert http.get("/health/live").status_code == 200  # draining or stopping is not dead
