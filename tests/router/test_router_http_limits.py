"""The router's HTTP read limits, as `sits serve` has them (security round 2, item 4): half-sent headers get
a 408 and the connection closes after --http-header-timeout (1 s here), while /health keeps answering at
once; raw sockets on 127.0.0.1 against a real `sits router` process (its one replica is down: /health
then answers 503 quickly, which is all the test needs)."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.services import RunningService, free_port, started

HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def router(tiny_llama_dir) -> Iterator[RunningService]:
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime.router", "--port", str(port), "--model", str(tiny_llama_dir),
            "--policy", "round-robin", "--replica", f"http://127.0.0.1:{free_port()}",
            "--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-max-connections", "64"]
    with started(argv, port, timeout_s=60, log_name="router.log") as service:
        yield service


def test_half_sent_headers_are_answered_408_and_closed_while_health_answers(router):
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as half:
        sent_at = time.monotonic()
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        started_health = time.monotonic()
        assert httpx.get(f"{router.url}/health", timeout=30).status_code in (200, 503)
        assert time.monotonic() - started_health < 1.0
        answer = b""
        while chunk := half.recv(4096):
            answer += chunk
        waited = time.monotonic() - sent_at
    assert answer.startswith(b"HTTP/1.1 408")
    assert HEADER_TIMEOUT_S * 0.9 < waited < 15


def test_a_bad_limit_is_a_one_line_error(tiny_llama_dir):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "sits.runtime.router", "--model", str(tiny_llama_dir),
                           "--replica", "http://127.0.0.1:9", "--http-header-timeout", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "header_timeout_s must be positive" in done.stderr
