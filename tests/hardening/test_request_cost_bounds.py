"""One request must not stall a shared server (issue 19, items 1, 2, 5 and 7).

A real `sits serve` process (tiny random Llama) with two tenants, a queue of exactly two sequences
(`--max-num-seqs 2 --max-waiting-requests 0`), a grammar-compile timeout of 1 s and one compile per
tenant with none waiting (a second is a 429 at once, which shows the first in flight); a thread polls
/health throughout each test and every answer must come within 1 s.

- A schema (or regex, grammar, choice list) nested deeper than the limit is a 400 naming the param
  it came from, at once, for every way of sending one (response_format, tools, structured_outputs,
  guided_*); a JSON schema sent as a string and nested 100,000 deep too, with no traceback logged.
- A schema under the depth limit that compiles for tens of seconds (550 nested arrays) is a 400
  after the 1 s timeout; while it compiles it holds no admission slot (another tenant's request
  for the whole queue, n = 2, is served) and its tenant cannot start a second compile (429).
- 128 bad_words of 100,000 characters each and a 200 KB stop string are 400s naming the param;
  bad_words at their limits are tokenized off the event loop.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sits.runtime.server.input_limits import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS_TOTAL_CHARS
from tests.hardening.conftest import tiny_server

KEYS = {"alice": "sk-alice-request-bounds", "bob": "sk-bob-request-bounds"}
SLOW_DEPTH = 550  # xgrammar needs tens of seconds for it (about the cube of the depth)
HEALTH_BOUND_S = 1.0


def nested_arrays(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("bounds") / "tenants.yaml"
    tenants.write_text("tenants:\n" + "".join(f'  - {{name: {name}, apiKey: "{key}"}}\n' for name, key in KEYS.items()))
    with tiny_server(tiny_llama_dir, "--tenants", str(tenants), "--max-num-seqs", "2", "--max-waiting-requests", "0",
                     "--grammar-max-depth", "600", "--grammar-compile-timeout", "1",
                     "--grammar-compiles-per-tenant", "1", "--grammar-compile-queue-per-tenant", "0") as service:
        yield service


def chat(server, tenant: str, timeout: float = 60.0, **body: Any) -> httpx.Response:
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=timeout,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"})


@contextmanager
def health_watch(server) -> Iterator[list[float]]:
    """Polls /health while the block runs; afterwards asserts every answer was 200 within the bound."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                assert client.get(f"{server.url}/health").status_code == 200
                latencies.append(time.monotonic() - started)
                stop.wait(0.05)

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        yield latencies
    finally:
        stop.set()
        watcher.join(60)
    assert latencies and max(latencies) < HEALTH_BOUND_S, f"/health took up to {max(latencies):.2f} s"


def assert_400(answer: httpx.Response, param: str) -> dict[str, Any]:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


def test_constraints_over_the_nesting_limit_are_400s_naming_their_param(server):
    too_deep = nested_arrays(700)  # over --grammar-max-depth 600
    function = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": too_deep}}}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": too_deep}}}, "response_format"),
        ({"structured_outputs": {"json": too_deep}, "n": 2}, "structured_outputs"),
        ({"guided_json": json.dumps(too_deep)}, "guided_json"),
        ({"guided_regex": "(" * 700 + "a" + ")" * 700}, "guided_regex"),
        ({"guided_grammar": "root ::= " + "(" * 700 + '"a"' + ")" * 700}, "guided_grammar"),
        ({"guided_choice": [f"{i}" + "x" * 1000 for i in range(200)]}, "guided_choice"),  # 200 KB of choices: over the size limit
        ({"tools": [function], "tool_choice": "required"}, "tools"),
    ]
    with health_watch(server):
        for body, param in cases:
            started = time.monotonic()
            error = assert_400(chat(server, "alice", timeout=30, **body), param)
            assert time.monotonic() - started < 5, f"{param}: refused only after compiling"
            assert "nests" in error["message"] or "bytes" in error["message"], error


def test_a_schema_string_nested_100000_deep_is_a_400_without_a_traceback(server):
    deep = '{"type":"array","items":' * 100_000 + "{}" + "}" * 100_000
    for body, param in (({"structured_outputs": {"json": deep}}, "structured_outputs"), ({"guided_json": deep}, "guided_json")):
        assert_400(chat(server, "alice", **body), param)
    log = (server.workdir / "serve.log").read_text(errors="replace")
    assert "Traceback" not in log and "RecursionError" not in log


def test_a_slow_compile_times_out_holds_no_slot_and_spares_other_tenants(server):
    def slow_request() -> httpx.Response:
        while True:  # a probe below may hold alice's one compile for a moment: then send again
            answer = chat(server, "alice", 120, structured_outputs={"json": nested_arrays(SLOW_DEPTH)}, n=2)
            if answer.status_code != 429:
                return answer

    assert chat(server, "bob", guided_choice=["warm"]).status_code == 200  # a worker is up
    with ThreadPoolExecutor(1) as pool, health_watch(server):
        slow = pool.submit(slow_request)
        # alice's slow compile is in flight once her next one is refused with 429 (one per tenant at a time)
        deadline, probe = time.monotonic() + 60, 0
        while True:
            probe += 1
            answer = chat(server, "alice", structured_outputs={"json": {"type": "array", "maxItems": probe}})
            if answer.status_code == 429:
                break
            assert answer.status_code == 200, answer.text
            assert time.monotonic() < deadline and not slow.done(), "alice's slow compile never showed in flight"
        assert answer.json()["error"]["code"] == "too_many_grammar_compiles" and answer.headers["Retry-After"]
        served = chat(server, "bob", n=2)  # the whole queue: free, although alice's n=2 request is compiling
        assert served.status_code == 200, served.text
        refused = slow.result(timeout=60)
    error = assert_400(refused, "structured_outputs")
    assert "longer than 1 s to compile" in error["message"], error
    assert chat(server, "alice", n=2).status_code == 200  # every slot and alice's compile budget are back


def test_huge_bad_words_and_stop_strings_are_400s(server):
    with health_watch(server):
        huge = ["w" * 100_000] * 128  # 12.8 MB: under the body limit, over the bad_words limits
        started = time.monotonic()
        assert_400(chat(server, "alice", bad_words=huge), "bad_words")
        assert time.monotonic() - started < 10
        assert_400(chat(server, "alice", bad_words=["w"] * 257), "bad_words")
        assert_400(chat(server, "alice", stop=["s" * 200_000]), "stop")
        assert_400(chat(server, "alice", stop=[f"s{i}" for i in range(65)]), "stop")
        words = [f"{i}" + "x" * (MAX_BAD_WORD_CHARS - 4) for i in range(MAX_BAD_WORDS_TOTAL_CHARS // MAX_BAD_WORD_CHARS)]
        assert chat(server, "bob", bad_words=words, stop=["y" * 1024] * 16, max_tokens=4).status_code == 200
