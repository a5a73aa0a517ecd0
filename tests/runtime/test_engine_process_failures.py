"""Failure behaviour of `sits serve` with the engine in its own process.

  - The engine process killed mid-load: requests that got output end with finish_reason "abort",
    the others get a 500 in OpenAI's shape; liveness turns 503; the server exits with code 3.
  - SIGTERM: the server drains and exits 0, and no process it started survives it.
  - SIGKILL of the server: its engine process (and the rest of its descendants) exit too.

Each test starts its own real `sits serve` over the embedded SmolLM2-135M (its steps are slow enough
on CPU that requests are surely in flight when the engine is killed). Child processes are found
and checked through /proc.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.processes import alive, children, cmdline, descendants, wait_all_gone
from tests.support.services import RunningService, free_port, started
from tests.support.streams import stream_completion

ENGINE_DIED_EXIT_CODE = 3


@pytest.fixture
def server(smollm2_checkpoint_dir) -> Iterator[RunningService]:
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--device", "cpu", "--port", str(port),
            "--num-blocks", "256", "--max-model-len", "2048", "--max-num-seqs", "1", "--drain-timeout", "30",
            "--log-level", "info"]
    with started(argv, port, timeout_s=180, log_name="serve.log") as service:
        deadline = time.monotonic() + 120
        while httpx.get(f"{service.url}/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield service


def engine_pid(server: RunningService) -> int:
    engines = [pid for pid in children(server.process.pid) if "spawn_main" in cmdline(pid)]
    assert len(engines) == 1, engines
    return engines[0]


def complete(url: str, into: dict) -> None:
    body = {"prompt": "Describe the ocean.", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    into["status"], into["body"] = response.status_code, response.json()


def waiting(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sits_requests_waiting{"))


def test_killing_the_engine_mid_load_fails_requests_cleanly_and_exits_non_zero(server):
    url = server.url
    engine = engine_pid(server)
    children = descendants(server.process.pid)
    streamed, started_streaming = {}, threading.Event()
    threads = [threading.Thread(target=stream_completion, args=(url, 1500, started_streaming, streamed))]
    threads[0].start()
    assert started_streaming.wait(60)
    queued = [{} for _ in range(3)]  # --max-num-seqs 1: these wait behind the stream
    threads += [threading.Thread(target=complete, args=(url, into)) for into in queued]
    for thread in threads[1:]:
        thread.start()
    deadline = time.monotonic() + 60
    while waiting(url) < len(queued):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    os.kill(engine, signal.SIGKILL)
    live = httpx.get(f"{url}/health/live", timeout=30)
    deadline = time.monotonic() + 10
    while live.status_code == 200 and time.monotonic() < deadline:  # the pipe's EOF is noticed at once
        live = httpx.get(f"{url}/health/live", timeout=30)
    assert live.status_code == 503

    for thread in threads:
        thread.join(60)
    # The stream had output: it ends cleanly with finish_reason "abort", then [DONE].
    assert streamed["status"] == 200 and streamed["events"][-1] == "[DONE]"
    reasons = [c["finish_reason"] for e in streamed["events"][:-1] for c in json.loads(e)["choices"]
               if c["finish_reason"]]
    assert reasons == ["abort"]
    # The queued requests never started: a 500 in OpenAI's shape.
    for into in queued:
        assert into["status"] == 500, into
        assert into["body"]["error"]["code"] == "engine_died"
        assert "engine process died" in into["body"]["error"]["message"]
    assert server.process.wait(30) == ENGINE_DIED_EXIT_CODE
    assert wait_all_gone(children, 10) == []
    log = (server.workdir / "serve.log").read_text()
    assert "exited unexpectedly" in log and "Traceback" not in log


def test_sigterm_drains_exits_0_and_leaves_no_child(server):
    url = server.url
    children = descendants(server.process.pid)
    assert engine_pid(server) in children
    into, first = {}, threading.Event()
    thread = threading.Thread(target=stream_completion, args=(url, 4, first, into))
    thread.start()
    assert first.wait(60)
    server.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert into["status"] == 200 and into["events"][-1] == "[DONE]"
    assert server.process.wait(60) == 0
    assert wait_all_gone(children, 10) == []


def test_sigkill_of_the_server_leaves_no_child(server):
    children = descendants(server.process.pid)
    engine = engine_pid(server)
    server.process.kill()  # no handler runs: the engine notices through PR_SET_PDEATHSIG and the pipe
    server.process.wait(30)
    assert wait_all_gone(children, 15) == []
    assert not alive(engine)


def test_tensor_parallel_workers_start_from_the_engine_process_and_die_with_the_server(tiny_llama_dir):
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--port", str(port), "--num-blocks", "64", "--max-model-len", "256", "--tensor-parallel-size", "2",
            "--log-level", "info"]
    with started(argv, port, timeout_s=180, log_name="serve.log") as service:
        response = httpx.post(f"{service.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert response.status_code == 200
        engine = engine_pid(service)
        workers = [pid for pid in descendants(engine) if "spawn_main" in cmdline(pid)]
        assert len(workers) == 1  # rank 1; rank 0 is the engine process itself
        everything = descendants(service.process.pid)
        service.process.kill()
        service.process.wait(30)
        assert wait_all_gone(everything, 15) == []
