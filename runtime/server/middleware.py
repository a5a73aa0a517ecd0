"""ASGI middleware: body size limit, and the gate in front of the generation endpoints.

Both are plain ASGI (not BaseHTTPMiddleware), so streamed responses pass through untouched and a
client disconnect still reaches the endpoint.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sits.runtime.server.admission import AdmissionControl
from sits.runtime.server.errors import OpenAIError, service_unavailable
from sits.runtime.server.lifecycle import Lifecycle
from sits.runtime.server.metrics import ServerMetrics
from sits.runtime.server.tenant import UNRESOLVED_TENANT, RequestTenant

CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request": the client left before the end


async def send_error(send: Send, error: OpenAIError) -> None:
    """Send an OpenAIError as a complete response from ASGI middleware."""
    response = error.to_response()
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class BodySizeLimit:
    """Reject request bodies over max_bytes with 413, by Content-Length or while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"Request body too large: the limit is {self.max_bytes} bytes."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await send_error(send, OpenAIError(413, self._too_large(), code="request_too_large"))
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes HTTPExceptions from body reading through to the error handlers.
                    raise StarletteHTTPException(413, self._too_large())
            return message

        await self.app(scope, limited_receive, send)


class GenerationGate:
    """In front of the generation endpoints: refuse while draining, count in-flight, record
    metrics, and give back the request's admitted sequences however it ends (the capacity check
    itself is `TenantGate`'s, after authentication).

    Handlers leave what they learn in the request state (`scope["state"]`): `tenant` (the
    `RequestTenant` the tenant gate resolved, `tenant_of`), `client_gone` (the client disconnected
    before the response ended) and the sequences `AdmissionControl.reserve` admitted.
    """

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, metrics: ServerMetrics, paths: set[str],
                 admission: AdmissionControl | None = None) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.paths = paths
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            self.metrics.observe_request(UNRESOLVED_TENANT, 503, 0.0)  # counted before the client reads it
            await send_error(send, service_unavailable("The server is shutting down; retry on another replica."))
            return
        started = time.perf_counter()
        status = 500
        observed = False
        state: dict[str, Any] = scope.setdefault("state", {})

        def observe() -> None:
            nonlocal observed
            if observed:
                return
            observed = True
            tenant: RequestTenant | None = state.get("tenant")
            self.metrics.observe_request(UNRESOLVED_TENANT if tenant is None else tenant.name,
                                         CLIENT_CLOSED_STATUS if state.get("client_gone") else status,
                                         time.perf_counter() - started)

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                observe()  # counted before the client can read the response's end (and then scrape)
            await send(message)

        self.lifecycle.enter()
        try:
            await self.app(scope, receive, tracking_send)
        finally:
            self.lifecycle.exit()
            if self.admission is not None:
                self.admission.release(state)
            observe()  # a response that never ended (the client left, an error): counted here
