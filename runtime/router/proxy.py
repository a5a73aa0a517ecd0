"""Forwarding one request to a replica, with one failover before the client's first byte.

A replica that refuses the connection, drops it before answering, or answers 503 is tried no
more for this request: the request goes to the next replica in the decision's order, once. A
whole answer (anything but an event stream) is read from the replica before the client gets any of
it, so a replica that dies between its headers and its body is failed over like one that dropped
the connection. An event stream is relayed chunk by chunk as it comes; once its headers are relayed
it is the client's (status and body unchanged), and one that breaks midway is never retried (its
bytes were sent).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from sits.runtime.router.metrics import RouterMetrics
from sits.runtime.router.replicas import Replica, ReplicaPool
from sits.runtime.server.errors import OpenAIError

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # the chosen replica and one failover
# Hop-by-hop headers, and what the router recomputes, never copied between the hops.
DROPPED_REQUEST_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                                     "upgrade", "te", "trailer", "proxy-authorization", "proxy-connection"})
# Bodies are relayed as raw bytes, so content-encoding stays; the length is re-framed by the router.
DROPPED_RESPONSE_HEADERS = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date",
                                      "server"})


class Forwarder:
    """Sends requests to replicas (see the module docstring).

    Args:
        client: the router's httpx client (no timeout on reads: generations are long).
        pool: the replicas, to take a failed one out.
        metrics: where attempts and errors are counted.
    """

    def __init__(self, client: httpx.AsyncClient, pool: ReplicaPool, metrics: RouterMetrics) -> None:
        self.client = client
        self.pool = pool
        self.metrics = metrics

    async def forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes,
                      order: list[Replica], reason: str) -> Response:
        """The first answer among `order[:MAX_ATTEMPTS]`, streamed through; 503 in OpenAI's shape
        when none answered (the last replica's own 503 when it answered one)."""
        sent_headers = [(k, v) for k, v in headers if k.lower() not in DROPPED_REQUEST_HEADERS]
        for attempt, replica in enumerate(order[:MAX_ATTEMPTS]):
            decision = reason if attempt == 0 else "failover"
            request = self.client.build_request(method, replica.url + path, headers=sent_headers, content=body)
            replica.in_flight += 1
            self._gauge(replica)
            self.metrics.requests.labels(replica.url, decision).inc()
            try:
                upstream = await self.client.send(request, stream=True)
            except httpx.ConnectError as error:
                self._failed(replica, "connect", error, take_out=True)
                continue
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.TimeoutException) as error:
                self._failed(replica, "disconnect", error, take_out=False)
                continue
            except BaseException:  # the client went away while the replica was being asked
                self._release(replica)
                raise
            if upstream.status_code == 503 and attempt + 1 < min(len(order), MAX_ATTEMPTS):
                await upstream.aread()
                await upstream.aclose()
                self._failed(replica, "status_503", None, take_out=False)
                continue
            if _is_event_stream(upstream):
                return self._relay(upstream, replica)
            try:
                return await self._whole(upstream, replica)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.TimeoutException) as error:
                self._failed(replica, "disconnect", error, take_out=False)
                continue
            except BaseException:  # the client went away while the body was being read
                self._release(replica)
                raise
        return OpenAIError(503, "no replica could take the request; retry later",
                           error_type="service_unavailable").to_response()

    async def _whole(self, upstream: httpx.Response, replica: Replica) -> Response:
        """A whole (not streamed) answer, read to its end before the client sees it.

        Raises:
            httpx.RemoteProtocolError / ReadError / TimeoutException: the replica broke off the body
                (nothing was sent to the client: the caller fails over).
        """
        try:
            body = b"".join([chunk async for chunk in upstream.aiter_raw()])  # raw: content-encoding passes through
        finally:
            await upstream.aclose()
        self._release(replica)
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS}
        return Response(body, status_code=upstream.status_code, headers=headers)

    def _relay(self, upstream: httpx.Response, replica: Replica) -> Response:
        """The replica's answer as the client's: status, headers (but hop-by-hop ones) and body."""
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS}
        finished = False

        async def finish() -> None:  # once, whether the stream ended, broke or the client left
            nonlocal finished
            if finished:
                return
            finished = True
            await upstream.aclose()
            self._release(replica)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as error:  # the replica broke off midway: bytes were sent, no retry
                self.metrics.upstream_errors.labels(replica.url, "stream").inc()
                log.warning("router: replica %s broke off a response midway (%s)", replica.url,
                            type(error).__name__)
            finally:
                await finish()

        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=headers,
                                 background=BackgroundTask(finish))

    def _failed(self, replica: Replica, kind: str, error: Exception | None, *, take_out: bool) -> None:
        self._release(replica)
        self.metrics.upstream_errors.labels(replica.url, kind).inc()
        if take_out:
            self.pool.mark_down(replica, f"connection refused ({type(error).__name__})")

    def _release(self, replica: Replica) -> None:
        """One request fewer in flight on `replica` (its attempt answered, failed, or was abandoned)."""
        replica.in_flight -= 1
        self._gauge(replica)

    def _gauge(self, replica: Replica) -> None:
        self.metrics.in_flight.labels(replica.url).set(replica.in_flight)


def _is_event_stream(upstream: httpx.Response) -> bool:
    return upstream.headers.get("content-type", "").split(";")[0].strip().lower() == "text/event-stream"


def unavailable() -> JSONResponse:
    return OpenAIError(503, "no replica is up; retry later", error_type="service_unavailable").to_response()
