"""`sits serve` with the engine in its own process (the default), against `--engine-in-process`.

Both servers are real `sits serve` subprocesses over the embedded SmolLM2-135M; the official
`openai` client talks to them. The engine process must give token-identical greedy outputs
(streamed and not), carry engine-side metrics across, and free a disconnected client's blocks.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from sits.runtime.commands.serve import engine_in_process
from tests.support.processes import children, cmdline
from tests.support.services import RunningService, free_port, started

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 12


def serve_argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sits.runtime", "serve", "--device", "cpu", "--dtype", "float32",
            "--port", str(port), "--num-blocks", "256", "--max-model-len", "2048", "--max-num-seqs", "4",
            "--log-level", "info", *extra]


def wait_ready(service: RunningService, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{service.url}/health", timeout=30).status_code != 200:
        assert service.process.poll() is None, "the server exited while starting"
        assert time.monotonic() < deadline
        time.sleep(0.1)


def client_of(service: RunningService) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def process_server(smollm2_checkpoint_dir) -> Iterator[RunningService]:
    port = free_port()
    with started(serve_argv(port), port, timeout_s=180, log_name="serve.log") as service:
        wait_ready(service)
        yield service


@pytest.fixture(scope="module")
def in_process_outputs(smollm2_checkpoint_dir) -> dict[str, tuple[str, list[str], list[float]]]:
    """Greedy outputs of the same model served by `--engine-in-process` (prompt -> text, tokens, logprobs)."""
    port = free_port()
    with started(serve_argv(port, "--engine-in-process"), port, timeout_s=180, log_name="serve.log") as service:
        wait_ready(service)
        assert not [pid for pid in children(service.process.pid) if "spawn_main" in cmdline(pid)]
        return {prompt: greedy(client_of(service), prompt) for prompt in PROMPTS}


def greedy(client: openai.OpenAI, prompt: str) -> tuple[str, list[str], list[float]]:
    completion = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                           max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    logprobs = completion.choices[0].logprobs
    return completion.choices[0].text, list(logprobs.tokens), list(logprobs.token_logprobs)


def metric(url: str, name: str) -> float:
    """The sum of a metric's series on the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, flags=re.M))


def test_the_engine_runs_in_a_child_process(process_server):
    engines = [pid for pid in children(process_server.process.pid) if "spawn_main" in cmdline(pid)]
    assert len(engines) == 1
    log = (process_server.workdir / "serve.log").read_text()
    assert f"engine process {engines[0]} ready" in log


def test_greedy_outputs_are_token_identical_to_the_in_process_engine(process_server, in_process_outputs):
    client = client_of(process_server)
    for prompt in PROMPTS:
        text, tokens, logprobs = greedy(client, prompt)
        ref_text, ref_tokens, ref_logprobs = in_process_outputs[prompt]
        assert (text, tokens) == (ref_text, ref_tokens)
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


def test_a_stream_gives_the_same_text_as_the_whole_response(process_server, in_process_outputs):
    client = client_of(process_server)
    model = client.models.list().data[0].id
    for prompt in PROMPTS:
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True))
        assert "".join(chunk.choices[0].text for chunk in chunks) == in_process_outputs[prompt][0]
        assert chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=8, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in chat if chunk.choices]
    assert "".join(pieces).strip()


def test_n_completions_and_prompt_logprobs_cross_the_process_boundary(process_server):
    client = client_of(process_server)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="Hello there", max_tokens=6, n=2, temperature=1.0,
                                           seed=7, echo=True, logprobs=0)
    assert len(completion.choices) == 2
    for choice in completion.choices:
        assert choice.text.startswith("Hello there")
        assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
        assert len(choice.logprobs.tokens) > 6


def test_engine_side_metrics_reach_metrics(process_server):
    before = metric(process_server.url, "sits_prefix_cache_queries_total")  # counted by the engine's scheduler
    client = client_of(process_server)
    client.completions.create(model=client.models.list().data[0].id, prompt="Count: one two three", max_tokens=3)
    deadline = time.monotonic() + 30
    while metric(process_server.url, "sits_prefix_cache_queries_total") <= before:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_client_that_disconnects_frees_its_kv_blocks(process_server):
    url = process_server.url
    body = {"prompt": "Write a very long essay about the sea.", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    holding = False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():  # streaming: the request holds KV blocks
            if line.startswith("data: ") and '"text":"' in line and metric(url, "sits_kv_cache_usage_ratio") > 0:
                holding = True
                break
        assert holding
    # The connection is closed: the server aborts the request and the engine process frees its blocks.
    deadline = time.monotonic() + 30
    while metric(url, "sits_kv_cache_usage_ratio") > 0 or metric(url, "sits_requests_running") > 0:
        assert time.monotonic() < deadline, "the disconnected request still holds KV blocks"
        time.sleep(0.05)


def test_the_escape_hatch_is_a_flag_or_an_environment_variable():
    assert not engine_in_process(argparse.Namespace(engine_in_process=False), {})
    assert engine_in_process(argparse.Namespace(engine_in_process=True), {})
    assert engine_in_process(argparse.Namespace(engine_in_process=False), {"SITS_ENGINE_IN_PROCESS": "1"})
    assert not engine_in_process(argparse.Namespace(engine_in_process=False), {"SITS_ENGINE_IN_PROCESS": "0"})
