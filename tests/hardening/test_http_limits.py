"""Slow or idle connections cannot use up the server (issue 19, item 4), and /metrics moves to its
own port (item 6), on a real `sits serve` process (tiny random Llama) with tenants:

- half-sent headers get a 408 and the connection closes after --http-header-timeout (1 s here);
  a body sent slower than --http-body-min-rate closes too; both are raw sockets on 127.0.0.1;
- past --http-max-connections open connections a new one gets a 503 at once, and once the idle
  ones are timed out, service is back;
- /health answers within 1 s throughout, and a tenant's completion succeeds meanwhile;
- with --metrics-port, /metrics is served there and not on the API port; /docs and /openapi.json
  are off in tenants mode; /v1/models shows no server path.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from tests.hardening.conftest import tiny_server
from tests.support.services import free_port

KEY = "sk-http-limits"
HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 24


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[tuple]:
    tenants = tmp_path_factory.mktemp("http") / "tenants.yaml"
    tenants.write_text(f'tenants:\n  - {{name: app, apiKey: "{KEY}"}}\n')
    metrics_port = free_port()
    with tiny_server(tiny_llama_dir, "--tenants", str(tenants), "--metrics-port", str(metrics_port),
                     "--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-body-min-rate", "1000",
                     "--http-max-connections", str(MAX_CONNECTIONS)) as service:
        yield service, metrics_port


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    started, received = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return received, time.monotonic() - started
        received += chunk


def health_ok(url: str) -> None:
    started = time.monotonic()
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert time.monotonic() - started < 1.0


def complete(url: str) -> None:
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert answer.status_code == 200, answer.text


def test_half_sent_headers_and_slow_bodies_are_closed(server):
    service, _ = server
    with connect(service.port) as half_headers, connect(service.port) as slow_body:
        sent_at = time.monotonic()
        half_headers.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n{\"prompt\":")
        health_ok(service.url)  # the server answers others meanwhile
        complete(service.url)
        answer, _ = read_until_closed(half_headers, 30)
        assert answer.startswith(b"HTTP/1.1 408") and HEADER_TIMEOUT_S * 0.9 < time.monotonic() - sent_at < 15
        # the body: 10 bytes in HEADER_TIMEOUT_S + 10 / 1000 s is far below 1000 bytes/s: closed
        read_until_closed(slow_body, 30)
        assert time.monotonic() - sent_at < 15
    health_ok(service.url)


def test_past_the_connection_cap_new_connections_get_503_until_idle_ones_time_out(server):
    service, _ = server
    with ExitStack() as stack:
        idle = [stack.enter_context(connect(service.port)) for _ in range(MAX_CONNECTIONS + 2)]
        refused, _ = read_until_closed(idle[-1], 30)  # beyond the cap: answered and closed at once
        assert refused.startswith(b"HTTP/1.1 503")
        for sock in idle[:MAX_CONNECTIONS - 4]:  # the idle ones are closed after the header timeout
            read_until_closed(sock, 30)
    deadline = time.monotonic() + 30
    while httpx.get(f"{service.url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
    health_ok(service.url)
    complete(service.url)


def test_metrics_port_docs_and_model_root(server, tiny_llama_dir):
    service, metrics_port = server
    complete(service.url)
    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30)
    assert scraped.status_code == 200 and 'tenant="app"' in scraped.text
    assert httpx.get(f"http://127.0.0.1:{metrics_port}/v1/models", timeout=30).status_code == 404
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{service.url}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404, path
    models = httpx.get(f"{service.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert models and all(str(tiny_llama_dir) not in card["root"] and not card["root"].startswith("/")
                          for card in models), models
