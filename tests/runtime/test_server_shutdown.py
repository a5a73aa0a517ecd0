"""SIGTERM on a `sits serve` process under load: drain, 503 for newcomers, clean streams, exit 0."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import httpx
import pytest

from tests.support.services import RunningService, free_port, started
from tests.support.streams import stream_completion

DRAIN_TIMEOUT_S = 6.0  # ample for the short stream on busy cores; the long one cannot finish


@pytest.fixture(scope="module")
def serve_process(smollm2_checkpoint_dir) -> RunningService:
    # smollm2_checkpoint_dir: the GGUF conversion is cached before the server process needs it.
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--device", "cpu", "--port", str(port),
            "--drain-timeout", str(DRAIN_TIMEOUT_S), "--num-blocks", "256", "--max-model-len", "2048",
            "--max-num-seqs", "8", "--log-level", "info"]
    with started(argv, port, timeout_s=180, log_name="serve.log") as service:
        deadline = time.monotonic() + 60
        while httpx.get(f"{service.url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield service


def finish_reasons(events: list[str]) -> list[str]:
    reasons = []
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    return reasons


def test_sigterm_drains_in_flight_streams_refuses_new_ones_and_exits_0(serve_process):
    url = serve_process.url
    short, long = {}, {}
    short_started, long_started = threading.Event(), threading.Event()
    threads = [threading.Thread(target=stream_completion, args=(url, 8, short_started, short)),
               threading.Thread(target=stream_completion, args=(url, 1500, long_started, long))]
    for thread in threads:
        thread.start()
    assert short_started.wait(60) and long_started.wait(60)

    serve_process.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while True:  # the signal is handled asynchronously: poll until the drain has begun
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        if refused.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(f"{url}/health").status_code == 503

    for thread in threads:
        thread.join(60)
    # The short stream finished normally; the long one was cut at the drain timeout, but both
    # ended cleanly: a final chunk with a finish_reason, then [DONE].
    assert short["status"] == 200 and short["events"][-1] == "[DONE]"
    assert finish_reasons(short["events"]) == ["length"]
    assert long["status"] == 200 and long["events"][-1] == "[DONE]"
    assert finish_reasons(long["events"]) == ["abort"]
    assert serve_process.process.wait(30) == 0
    log = (serve_process.workdir / "serve.log").read_text()
    assert "draining" in log and "Traceback" not in log
