"""Who may read /metrics, where: the API port, or a metrics-only listener (`--metrics-port`).

/metrics names every tenant with its traffic, latency and KV use, so in tenants mode (`--tenants`)
it is not open on the API port:

- with `--metrics-port PORT`, /metrics is served only by a second, small listener on that port
  (`MetricsListener`, GET /metrics and nothing else; keep that port inside the cluster: the chart's
  ServiceMonitor scrapes it and its NetworkPolicy admits only Prometheus); the API port answers 404;
- without it, /metrics on the API port needs the key of a tenant marked `admin: true` (401 without
  a key, 403 for another tenant's key), as the LoRA endpoints do.

Without tenants /metrics stays open on the API port (as vLLM serves it), unless `--metrics-port`
moves it. In tenants mode /docs, /redoc and /openapi.json are off unless `--enable-api-docs`
(`api_docs_urls`), and `/v1/models` shows no server path in `root` (`public_model_root`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, TypedDict

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from sits.runtime.lora.config import HF_SCHEME
from sits.runtime.server.errors import OpenAIError
from sits.runtime.server.metrics import CONTENT_TYPE
from sits.runtime.server.tenant import request_tenant, tenant_of

METRICS_PATH = "/metrics"
LISTENER_SOCKET_TIMEOUT_S = 10.0  # a scrape connection that stalls is dropped after this long


def install_metrics_route(app: FastAPI, exposition: Callable[[], bytes], *, tenants_mode: bool,
                          metrics_port: int | None) -> None:
    """Add GET /metrics to the API app as the rules above say (nothing when a metrics port serves it)."""
    if metrics_port is not None:
        return
    dependencies = [Depends(_admin_tenant)] if tenants_mode else []

    @app.get(METRICS_PATH, dependencies=dependencies, include_in_schema=False)
    async def prometheus_metrics() -> Response:
        # On a worker thread: the engine builds its figures between two steps, and the scrape waits
        # for the step in flight without holding up the event loop (and every stream on it).
        return Response(await asyncio.to_thread(exposition), media_type=CONTENT_TYPE)


async def _admin_tenant(request: Request, _tenant: str = Depends(request_tenant)) -> None:
    """401 without a valid key (request_tenant), 403 unless the tenant is marked admin."""
    tenant = tenant_of(request)
    if tenant is None or not tenant.admin:
        raise OpenAIError(403, "With tenants, /metrics on the API port needs the key of a tenant marked "
                               "`admin: true` (or scrape the --metrics-port listener).", code="permission_denied")


class ApiDocUrls(TypedDict):
    """FastAPI's arguments that serve (a path) or hide (None) the API docs."""

    docs_url: str | None
    redoc_url: str | None
    openapi_url: str | None


def api_docs_urls(enabled: bool | None, tenants_mode: bool) -> ApiDocUrls:
    """FastAPI's docs_url / redoc_url / openapi_url: off in tenants mode unless enabled (None: the default)."""
    on = (not tenants_mode) if enabled is None else enabled
    if on:
        return ApiDocUrls(docs_url="/docs", redoc_url="/redoc", openapi_url="/openapi.json")
    return ApiDocUrls(docs_url=None, redoc_url=None, openapi_url=None)


def public_model_root(source: str | None, model_name: str) -> str:
    """What /v1/models shows as a model's `root`: an hf:// id as given, else the model's name —
    never a path of the server's file system."""
    return source if source and source.startswith(HF_SCHEME) else model_name


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True
    exposition: Callable[[], bytes] | None = None  # set before serving


class _MetricsServerV6(_MetricsServer):
    address_family = socket.AF_INET6


class _MetricsHandler(BaseHTTPRequestHandler):
    server: _MetricsServer
    timeout = LISTENER_SOCKET_TIMEOUT_S

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] != METRICS_PATH:
            self.send_error(404)
            return
        exposition = self.server.exposition
        if exposition is None:
            self.send_error(503)
            return
        body = exposition()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # scrapes are not worth a log line each


class MetricsListener:
    """A second HTTP listener that serves GET /metrics only, in a daemon thread.

    Args:
        host, port: where to listen (port 0: a free one; `port` tells which).
        exposition: returns the Prometheus text (e.g. `ServerMetrics.exposition`); may be given
            later to `start` (bind first, so a taken port fails before the model loads).
    Binds at construction (OSError when the port is taken). Use as a context manager, or
    `start()` / `stop()`.
    """

    def __init__(self, host: str, port: int, exposition: Callable[[], bytes] | None = None) -> None:
        server_class = _MetricsServerV6 if ":" in host else _MetricsServer
        self._server = server_class((host, port), _MetricsHandler)
        self._server.exposition = exposition
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"sits-metrics-{self.port}",
                                        daemon=True)

    def start(self, exposition: Callable[[], bytes] | None = None) -> MetricsListener:
        if exposition is not None:
            self._server.exposition = exposition
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(10)
        self._server.server_close()

    def __enter__(self) -> MetricsListener:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
