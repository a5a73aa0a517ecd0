"""`sits router --replica-metrics-port`: a replica's identity (state-store name, track) is read from
its /metrics on the replicas' `--metrics-port`, as the operator deploys them, not on the API port."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from sits.runtime.config import ConfigError
from sits.runtime.router.config import RouterConfig
from sits.runtime.router.replicas import ReplicaPool, metrics_url

METRICS = b'# TYPE sits_state_store_replica gauge\nsits_state_store_replica{replica_id="pod-7",track="canary"} 1.0\n'


def handler(routes: dict[str, bytes]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = routes.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextlib.contextmanager
def serving(routes: dict[str, bytes]) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(routes))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def replica() -> Iterator[tuple[int, int]]:
    """(API port: /health only, metrics port: /metrics only) of one fake replica host."""
    with serving({"/health": b"ok"}) as api, serving({"/metrics": METRICS}) as metrics:
        yield api, metrics


async def identify(url: str, metrics_port: int | None) -> tuple[bool, str | None, str]:
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool([url], client, interval_s=2.0, metrics_port=metrics_port)
        await pool.probe(pool.replicas[0])
        found = pool.replicas[0]
        return found.up, found.replica_id, found.track


def test_identity_is_read_on_the_metrics_port(replica):
    api, metrics = replica
    assert asyncio.run(identify(f"http://127.0.0.1:{api}", metrics)) == (True, "pod-7", "canary")
    # Without the flag /metrics is asked on the API port, which has none: up, identity unknown
    assert asyncio.run(identify(f"http://127.0.0.1:{api}", None)) == (True, None, "stable")


def test_metrics_url():
    assert metrics_url("http://10.0.0.5:8000", None) == "http://10.0.0.5:8000/metrics"
    assert metrics_url("http://10.0.0.5:8000", 9400) == "http://10.0.0.5:9400/metrics"
    assert metrics_url("http://[fd00::5]:8000", 9400) == "http://[fd00::5]:9400/metrics"


def test_a_bad_metrics_port_is_refused():
    with pytest.raises(ConfigError, match="--replica-metrics-port"):
        RouterConfig(replicas=["http://127.0.0.1:8000"], replica_metrics_port=70000).validate()
