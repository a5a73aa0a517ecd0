"""Streamed responses byte for byte, on either HTTP stack the server may run (issue 12: the API process's cost
per streamed chunk).

`sits serve` runs uvloop and httptools where they are installed and falls back to asyncio and h11 otherwise
(`http_limits.server_backends`); streamed chunks go out through `EventStreamResponse`. What a client reads must
not depend on either: the raw SSE bodies of a few streamed requests (chat with continuous usage, completions with
n=2 and echo, a stop string, logprobs) are pinned here as the server sent them before the streaming path was
rewritten (ids and timestamps aside), and must come out the same on both stacks, through raw HTTP and through the
official openai client. A tiny random model (token-id tokenizer) with `logit_bias` forcing the sampled token keeps
the text independent of the weights' numerics; the pinned requests generate one token, so their chunks do not
depend on timing either.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.engine.errors import EngineDiedError
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.random_model import random_loaded_model
from sits.runtime.server.event_stream import EventStreamResponse
from sits.runtime.server.http_limits import GuardedH11Protocol, server_backends, uvicorn_options
from sits.runtime.server.limits_config import HttpLimits
from tests.support.serving import openai_client, serve_loaded

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, max_position_embeddings=128, eos_token_ids=[2])
FORCED = {"9": 100}  # every sampled token is 9 (text " 9"), whatever the random weights say

# name -> (path, request body): what the pinned bodies below answer.
REQUESTS = {
    "chat_usage": ("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "5 6 7"}], "max_tokens": 1, "stream": True,
        "logit_bias": FORCED, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "completions_n2_echo": ("/v1/completions", {
        "model": "tiny", "prompt": "5 6 7", "n": 2, "echo": True, "max_tokens": 1, "stream": True,
        "logit_bias": FORCED, "stream_options": {"include_usage": True}}),
    "completions_stop": ("/v1/completions", {
        "model": "tiny", "prompt": "5 6", "max_tokens": 1, "stream": True, "logit_bias": FORCED,
        "stop": ["9"]}),
    "chat_logprobs_top0": ("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "5"}], "max_tokens": 1, "stream": True,
        "logit_bias": FORCED, "logprobs": True, "top_logprobs": 0}),
}

# The bodies as the server sent them before the rewrite (recorded by running this file as a script, below).
PINNED: dict[str, str] = json.loads((Path(__file__).parent / "event_stream_pinned.json").read_text())


def normalized(body: str) -> str:
    """The SSE body with its per-request values (id, created, logprob floats) replaced by placeholders."""
    body = re.sub(r'"id":"[a-z]+-[0-9a-f]+"', '"id":"ID"', body)
    body = re.sub(r'"created":\d+', '"created":0', body)
    return re.sub(r'"logprob":-?[0-9.e+-]+', '"logprob":"X"', body)


@pytest.fixture(scope="module", params=["uvloop+httptools", "asyncio+h11"])
def server(request) -> Iterator:
    loaded = random_loaded_model(TINY, TorchAttentionBackend(), "cpu", torch.float32, seed=0, name="tiny")
    patch = pytest.MonkeyPatch()
    if request.param == "asyncio+h11":  # as where neither is installed: importing them fails
        patch.setitem(sys.modules, "uvloop", None)
        patch.setitem(sys.modules, "httptools", None)
    try:
        serving = serve_loaded(loaded, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
        served, _ = serving.__enter__()  # the server chose its loop and parser when it started
    finally:
        patch.undo()
    try:
        yield served, request.param
    finally:
        serving.__exit__(None, None, None)


def raw_body(url: str, path: str, body: dict) -> str:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
        assert response.headers["x-request-id"].startswith(("chatcmpl-", "cmpl-"))
        return response.read().decode()


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_streamed_bodies_are_byte_for_byte_what_the_server_sent_before(server, name):
    served, _ = server
    path, body = REQUESTS[name]
    assert normalized(raw_body(served.url, path, body)) == PINNED[name]


def test_the_openai_client_reads_the_whole_stream_on_both_stacks(server):
    """Several tokens per stream: how many chunks carry them depends on timing (a consumer that falls behind
    gets merged deltas), what they add up to does not."""
    served, backend = server
    loop, http = backend.split("+")
    assert served.server.config.loop == loop and http in served.server.config.http_protocol_class.__name__.lower()
    client = openai_client(served)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "5 6 7"}], max_tokens=3, stream=True,
        logit_bias=FORCED, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == " 9 9 9"
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-2:] == [None, "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert len({c.id for c in chunks}) == 1
    completion = client.completions.create(model="tiny", prompt="5 6", max_tokens=6, stream=True,
                                           logit_bias=FORCED, stop=["9 9"])
    chunks = list(completion)
    assert "".join(c.choices[0].text for c in chunks) == " ", backend
    assert chunks[-1].choices[0].finish_reason == "stop"


def run_response(events, *, leave_after: int | None = None) -> tuple[list[dict], dict]:
    """Drive an EventStreamResponse of `events` as the ASGI server would, the client leaving once
    `leave_after` messages went out (None: it stays); the messages sent and the request state."""
    messages: list[dict] = []
    state: dict = {}

    async def run() -> None:
        left = asyncio.Event()

        async def send(message: dict) -> None:
            messages.append(message)
            if len(messages) == leave_after:
                left.set()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        response = EventStreamResponse(events, state, {"x-request-id": "cmpl-1"})
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

    asyncio.run(run())
    return messages, state


def test_an_error_after_the_200_is_an_error_event_then_done_in_the_last_message():
    async def events():
        yield 'data: {"n":1}\n\n'
        raise EngineDiedError("the engine process exited")

    messages, state = run_response(events())
    start, first, last = messages
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-request-id", b"cmpl-1") in start["headers"] and (b"cache-control", b"no-cache") in start["headers"]
    assert first == {"type": "http.response.body", "body": b'data: {"n":1}\n\n', "more_body": True}
    assert last["more_body"] is False and last["body"].endswith(b"\n\ndata: [DONE]\n\n")
    error = json.loads(last["body"].decode().split("\n\n")[0].removeprefix("data: "))["error"]
    assert error["code"] == "engine_died" and "exited" in error["message"]
    assert "client_gone" not in state


def test_a_client_that_leaves_closes_the_events_and_is_marked_gone():
    closed = []

    async def events():
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()  # the engine has nothing more yet
            yield "data: 2\n\n"
        finally:
            closed.append(True)  # where the engine request is aborted

    messages, state = run_response(events(), leave_after=2)
    assert closed == [True] and state["client_gone"] is True
    assert [m.get("more_body") for m in messages] == [None, True]  # no end: the client is gone


def test_the_fastest_installed_loop_and_parser_are_chosen_and_missing_ones_fall_back(monkeypatch):
    assert server_backends() == ("uvloop", "httptools")  # both are dependencies of the package
    options = uvicorn_options(HttpLimits())
    assert options["loop"] == "uvloop" and options["http"].__name__ == "GuardedHttpToolsProtocol"
    assert uvicorn_options(None) == {"loop": "uvloop", "http": "httptools"}
    monkeypatch.setitem(sys.modules, "httptools", None)
    assert server_backends() == ("uvloop", "h11")
    assert issubclass(uvicorn_options(HttpLimits())["http"], GuardedH11Protocol)
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert server_backends() == ("asyncio", "h11")
    assert uvicorn_options(None) == {"loop": "asyncio", "http": "h11"}


if __name__ == "__main__":  # prints the bodies the running code sends (how event_stream_pinned.json was recorded)
    loaded = random_loaded_model(TINY, TorchAttentionBackend(), "cpu", torch.float32, seed=0, name="tiny")
    with serve_loaded(loaded, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64) as (served, _):
        for key, (path, request_body) in sorted(REQUESTS.items()):
            print(f"PINNED[{key!r}] = {normalized(raw_body(served.url, path, request_body))!r}")
