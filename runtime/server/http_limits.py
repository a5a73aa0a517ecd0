"""HTTP read timeouts and a connection cap for the uvicorn server.

uvicorn times out idle keep-alive connections, but not a connection that sends half its headers
or its body a byte at a time: such connections stay open for ever, and enough of them use up the
process's file descriptors (then /health and real requests time out, and asyncio logs a
traceback per failed accept). So the server runs `guarded_protocol(limits)` — uvicorn's httptools
protocol (h11's where httptools is not installed) with:

- a **header timeout**: a connection has `header_timeout_s` from when it opens (or from the first
  byte of a next request on a kept-alive connection) to send complete headers; else 408 and close;
- a **minimum body rate**: once the headers are in, the body must arrive within
  `header_timeout_s + received_bytes / body_min_rate` seconds of them (time while the server
  itself paused reading, because the app is slow to consume, does not count); else the connection
  closes and the app sees the client gone;
- a **connection cap**: beyond `max_connections` open connections a new one gets a 503 and is
  closed at once, and uvicorn's `limit_concurrency` (the same number) answers 503 to requests
  beyond it, long before descriptors run out;

and asyncio's "socket.accept() out of system resource" errors are logged at most once per
`ACCEPT_ERROR_LOG_INTERVAL_S` with a count of those left out (`AcceptErrorLogFilter`).
`uvicorn_options(limits)` gives the uvicorn.Config arguments, with uvloop as the event loop where it is
installed (`server_backends`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sits.runtime.server.limits_config import HttpLimits

logger = logging.getLogger("sits.server")

ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
_ACCEPT_ERROR = "socket.accept() out of system resource"
_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_FULL_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 20\r\n"
             b"connection: close\r\n\r\nToo many connections")


class _RefusalLog:
    """Rate-limited warning for connections refused by the cap (at most one line per interval)."""

    def __init__(self) -> None:
        self.refused = 0
        self._logged_at = float("-inf")
        self._since_log = 0

    def record(self) -> None:
        self.refused += 1
        self._since_log += 1
        now = time.monotonic()
        if now - self._logged_at >= ACCEPT_ERROR_LOG_INTERVAL_S:
            logger.warning("connection cap reached: refused %d connection(s) with 503 since the last report",
                           self._since_log)
            self._logged_at, self._since_log = now, 0


IDLE, BODY, IN_APP = "idle", "body", "in_app"  # where a connection's current request is (`_phase`)


class _ReadDeadlines:
    """The guard over a uvicorn HTTP protocol (h11's or httptools'): header/body read deadlines and the
    connection cap (`limits`). The protocol class says which phase its request is in (`_phase`)."""

    limits: HttpLimits = HttpLimits()
    refusals: _RefusalLog  # one per server (`guarded_protocol`)
    # What the uvicorn protocol it is mixed into provides:
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    connections: set[Any]
    client: tuple[str, int] | None
    cycle: Any
    flow: Any

    def _phase(self) -> str:
        """IDLE (waiting for or reading headers), BODY (reading the body) or IN_APP (read in full)."""
        raise NotImplementedError

    def _unparsed_bytes(self) -> bool:
        """Whether bytes of a next request are already buffered (h11 holds them until a response ends)."""
        return False

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._header_deadline: float | None = None
        self._body_started: float | None = None
        self._body_bytes = 0
        if len(self.connections) > self.limits.max_connections:
            self.refusals.record()
            transport.write(_FULL_503)
            transport.close()
            return
        self._header_deadline = self.loop.time() + self.limits.header_timeout_s
        self._arm(self._header_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        self._follow(len(data))

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._follow(0)

    def _follow(self, received: int) -> None:
        """Arm the deadline of the phase the request is in (headers, body) or drop it (done)."""
        phase = self._phase()
        now = self.loop.time()
        if phase == IDLE:
            self._body_started = None
            if self._header_deadline is None and (received or self._unparsed_bytes()):
                self._header_deadline = now + self.limits.header_timeout_s
                self._arm(self._header_deadline)
        elif phase == BODY:
            self._header_deadline = None
            if self._body_started is None:
                self._body_started, self._body_bytes = now, 0
            else:
                self._body_bytes += received
            if self._deadline_timer is None:
                self._arm(self._body_deadline())
        else:  # the request is in (or the connection is ending): the app's time is not bounded here
            self._header_deadline = self._body_started = None
            self._disarm()

    def _body_deadline(self) -> float:
        assert self._body_started is not None
        return self._body_started + self.limits.header_timeout_s + self._body_bytes / self.limits.body_min_rate

    def _arm(self, when: float) -> None:
        self._disarm()
        self._deadline_timer = self.loop.call_at(when, self._on_deadline)

    def _disarm(self) -> None:
        timer = getattr(self, "_deadline_timer", None)
        if timer is not None:
            timer.cancel()
            self._deadline_timer = None

    def _on_deadline(self) -> None:
        self._deadline_timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        phase = self._phase()
        if phase == IDLE and self._header_deadline is not None:
            if now < self._header_deadline:
                self._arm(self._header_deadline)
                return
            logger.info("closing a connection from %s: no complete headers within %.1f s", _peer(self.client),
                        self.limits.header_timeout_s)
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(_TIMEOUT_408)
            self.transport.close()
        elif phase == BODY and self._body_started is not None:
            if self.flow.read_paused:  # our own back-pressure, not the client's slowness
                self._body_started, self._body_bytes = now, 0
            deadline = self._body_deadline()
            if now < deadline:
                self._arm(deadline)
                return
            logger.info("closing a connection from %s: its request body arrives slower than %.0f bytes/s",
                        _peer(self.client), self.limits.body_min_rate)
            self.transport.close()


class GuardedH11Protocol(_ReadDeadlines, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the read deadlines and the connection cap."""

    def _phase(self) -> str:
        state = self.conn.their_state
        return IDLE if state is h11.IDLE else BODY if state is h11.SEND_BODY else IN_APP

    def _unparsed_bytes(self) -> bool:
        return bool(self.conn.trailing_data[0])


def guarded_httptools_protocol_base() -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with the read deadlines, or None where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class GuardedHttpToolsProtocol(_ReadDeadlines, HttpToolsProtocol):
        """uvicorn's httptools protocol (llhttp, in C) with the read deadlines and the connection cap.

        httptools parses every byte as it arrives, so the phase follows its callbacks: headers
        complete -> BODY (IN_APP for a websocket upgrade, as h11's protocol-switch state), message
        complete -> IN_APP, response sent -> IDLE again (unless a pipelined request was parsed
        meanwhile: its phase stands).
        """

        _request_phase = IDLE

        def _phase(self) -> str:
            return self._request_phase

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            upgrading = self.parser.should_upgrade() and self._should_upgrade()  # handed to the websocket protocol
            self._request_phase = IN_APP if upgrading else BODY

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._request_phase = IN_APP

        def on_response_complete(self) -> None:
            if not self.pipeline and self._request_phase == IN_APP:
                self._request_phase = IDLE
            super().on_response_complete()

    return GuardedHttpToolsProtocol


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def guarded_protocol(limits: HttpLimits, http: str = "h11") -> type[asyncio.Protocol]:
    """The guarded protocol class of `http` ("httptools" or "h11") bound to `limits` (uvicorn
    instantiates the class it is given); h11's where httptools is not installed."""
    limits.validate()
    base = guarded_httptools_protocol_base() if http == "httptools" else None
    base = base or GuardedH11Protocol
    return type(base.__name__, (base,), {"limits": limits, "refusals": _RefusalLog()})


def server_backends() -> tuple[str, str]:
    """The event loop and HTTP parser uvicorn runs: ("uvloop", "httptools") where they are installed
    (as `uvicorn[standard]` and vLLM run; a streamed chunk costs the event loop about half as much),
    else ("asyncio", "h11"), each chosen on its own."""
    return ("uvloop" if _importable("uvloop") else "asyncio", "httptools" if _importable("httptools") else "h11")


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


class AcceptErrorLogFilter(logging.Filter):
    """Lets asyncio's "socket.accept() out of system resource" through at most once per interval
    (the first of each interval, without its traceback, with the count of those left out)."""

    def __init__(self, interval_s: float = ACCEPT_ERROR_LOG_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.suppressed = 0
        self._logged_at = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_ACCEPT_ERROR):
            return True
        now = time.monotonic()
        if now - self._logged_at < self.interval_s:
            self.suppressed += 1
            return False
        error = record.exc_info[1] if record.exc_info else None
        record.msg = f"{_ACCEPT_ERROR} ({error}); {self.suppressed} more in the last {self.interval_s:g} s not logged"
        record.args, record.exc_info, record.exc_text = (), None, None
        self._logged_at, self.suppressed = now, 0
        return True


def install_accept_error_filter(target: logging.Logger | None = None) -> AcceptErrorLogFilter:
    """Add the filter to asyncio's logger once (idempotent); returns the filter in place."""
    target = target or logging.getLogger("asyncio")
    for existing in target.filters:
        if isinstance(existing, AcceptErrorLogFilter):
            return existing
    added = AcceptErrorLogFilter()
    target.addFilter(added)
    return added


def uvicorn_options(limits: HttpLimits | None) -> dict[str, Any]:
    """uvicorn.Config arguments: the event loop and HTTP protocol (`server_backends`), guarded by
    `limits` when given (`guarded_protocol`)."""
    loop, http = server_backends()
    if limits is None:
        return {"loop": loop, "http": http}
    install_accept_error_filter()
    return {"loop": loop, "http": guarded_protocol(limits, http), "limit_concurrency": limits.max_connections}
