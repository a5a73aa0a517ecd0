"""`sits serve --api-key` (vLLM's): a server without tenants behind one or more keys.

One real `sits serve` process on the tiny random Llama, with two keys and debug logging, called
through the official openai client: no key or a wrong one is OpenAI's 401 on every /v1/* route and
on /tokenize, /detokenize; either key is served; /health, /metrics and /version stay open; no key
reaches the log or /metrics. The flag's parsing ($SITS_API_KEY, clashes with --tenants) without a server.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sits.runtime import cli
from sits.runtime.commands.engine_args import ConfigError
from sits.runtime.commands.serve import API_KEY_ENV, api_keys_from_args
from sits.runtime.server.tenant import ApiKeyResolver
from tests.support.services import free_port, started

FIRST_KEY, SECOND_KEY, WRONG_KEY = "sk-first-7d2c91e4", "sk-second-b03f5a88", "sk-wrong-5e61c0d2"
MODEL = "tiny-llama"


def serve_argv(model_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "sits.runtime", "serve", "--model", str(model_dir), "--device", "cpu",
            "--served-model-name", MODEL, "--port", str(port), "--max-model-len", "128", "--kv-cache-gb", "0.02",
            "--api-key", FIRST_KEY, "--api-key", SECOND_KEY, "--log-level", "debug"]


def client_for(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def call_every_route(client: openai.OpenAI) -> None:
    """Chat, completions and models through the openai client (each raises on a refusal)."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_sits_serve_with_two_api_keys_refuses_others_and_never_shows_a_key(tiny_llama_dir):
    port = free_port()
    with started(serve_argv(tiny_llama_dir, port), port, timeout_s=120, log_name="serve.log") as server:
        url = server.url
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:  # open, and ready once it answers 200
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)

        # No key, or a wrong one: OpenAI's 401 on every protected route, before the body is read.
        with pytest.raises(openai.AuthenticationError) as wrong:
            call_every_route(client_for(url, WRONG_KEY))
        assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
        for bad_key in (WRONG_KEY, FIRST_KEY + "x", FIRST_KEY[:-1]):
            with pytest.raises(openai.AuthenticationError):
                client_for(url, bad_key).models.list()
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("POST", "/tokenize"), ("POST", "/detokenize")):
            for headers in ({}, {"Authorization": f"Basic {FIRST_KEY}"}, {"Authorization": f"Bearer {WRONG_KEY}"}):
                refused = httpx.request(method, f"{url}{path}", headers=headers, content=b'{"prompt": "hi", ')
                assert refused.status_code == 401, (path, headers, refused.text)
                assert refused.headers["www-authenticate"] == "Bearer"
                assert set(refused.json()["error"]) == {"message", "type", "param", "code"}

        # Either key serves every route; a key with a broken body gets the body's 400.
        for key in (FIRST_KEY, SECOND_KEY):
            call_every_route(client_for(url, key))
            auth = {"Authorization": f"Bearer {key}"}
            tokens = httpx.post(f"{url}/tokenize", json={"prompt": "Hello there"}, headers=auth)
            assert tokens.status_code == 200 and tokens.json()["count"] >= 2
            text = httpx.post(f"{url}/detokenize", json={"tokens": tokens.json()["tokens"]}, headers=auth)
            assert text.status_code == 200 and "Hello there" in text.json()["prompt"]
            broken = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi", ', headers=auth)
            assert broken.status_code == 400

        # Health, metrics and version stay open; the requests count under the tenant "default".
        assert httpx.get(f"{url}/version").status_code == 200
        metrics = httpx.get(f"{url}/metrics")
        assert metrics.status_code == 200
        served = sum(sample.value for family in text_string_to_metric_families(metrics.text)
                     for sample in family.samples if sample.name == "sits_requests_total"
                     and sample.labels.get("tenant") == "default" and sample.labels.get("status") == "200")
        assert served >= 2 * 2  # chat and completions, once per key
        log = (server.workdir / "serve.log").read_text(errors="replace")

    assert "api_key (2 key(s))" in log and "DEBUG" in log  # the startup line says keys guard it, at debug level
    for secret in (FIRST_KEY, SECOND_KEY, WRONG_KEY, FIRST_KEY.rsplit("-", 1)[1], SECOND_KEY.rsplit("-", 1)[1]):
        assert secret not in log and secret not in metrics.text
    assert "Traceback" not in log


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def test_api_keys_come_from_the_flags_else_from_sits_api_key():
    assert api_keys_from_args(parse("--api-key", "a", "--api-key", "b"), {API_KEY_ENV: "env"}) == ("a", "b")
    assert api_keys_from_args(parse(), {API_KEY_ENV: " sk-env "}) == ("sk-env",)
    assert api_keys_from_args(parse(), {}) == ()
    assert api_keys_from_args(parse(), {API_KEY_ENV: ""}) == ()  # set but empty: open, as vLLM reads it
    with pytest.raises(ConfigError, match="--api-key must not be empty"):
        api_keys_from_args(parse("--api-key", " "), {})
    with pytest.raises(ConfigError, match=f"{API_KEY_ENV} and --tenants"):
        api_keys_from_args(parse("--tenants", "t.yaml"), {API_KEY_ENV: "sk-env"})
    assert api_keys_from_args(parse("--tenants", "t.yaml"), {}) == ()


def test_api_key_with_tenants_is_one_line_and_exit_2(tmp_path, capsys):
    tenants = tmp_path / "f.yaml"
    tenants.write_text('tenants: [{name: finance, apiKey: "sk-1"}]')
    code = cli.main(["serve", "--port", "0", "--api-key", "sk-secret-x", "--tenants", str(tenants)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("sits serve: error: --api-key and --tenants")
    assert "sk-secret-x" not in err


def test_the_resolver_keeps_no_key_in_clear():
    resolver = ApiKeyResolver([FIRST_KEY, SECOND_KEY])
    shown = repr(resolver) + repr(vars(resolver)) + repr(vars(resolver._keys)) + repr(resolver._keys.authenticator)
    assert FIRST_KEY not in shown and SECOND_KEY not in shown and "2 key(s)" in repr(resolver)
    with pytest.raises(ValueError):
        ApiKeyResolver([])
