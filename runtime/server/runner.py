"""Running the app under uvicorn: in the foreground with a graceful drain, or in a background thread.

Foreground (`run_server`, what `sits serve` calls): the first SIGTERM or SIGINT starts the drain
(readiness false, new requests 503, in-flight ones finish for up to drain_timeout_s, then the rest
are aborted) and the process then exits 0; a second signal stops at once. If the engine dies (its
process killed, a step crashed), in-flight requests have already failed and the server stops at once
with exit code 3 (`ENGINE_DIED_EXIT_CODE`), so the pod is restarted.

Background (`BackgroundServer`): the same app in a thread with its own event loop, on a free port —
for tests, benchmarks and notebooks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

from sits.runtime.engine.client import EngineClient
from sits.runtime.server.http_limits import uvicorn_options

logger = logging.getLogger("sits.server")

GRACEFUL_CLOSE_S = 5.0  # after the drain, how long uvicorn waits for connections to close
ENGINE_DIED_EXIT_CODE = 3  # the engine crashed or its process died: Kubernetes restarts the pod
# After the engine died, how long the server still answers (health 503, the failed requests' last
# bytes) before it stops: probes and load balancers see the failure instead of a refused connection.
ENGINE_DEATH_LINGER_S = 2.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first shutdown signal drains the app instead of stopping it at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, engine: EngineClient, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._engine = engine
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._drain_requested = False
        self.exit_code = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        watcher = asyncio.ensure_future(self._exit_when_engine_dies())
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()

    async def _exit_when_engine_dies(self) -> None:
        await self._engine.wait_until_dead()
        if self.should_exit and self.exit_code == 0 and self._drain_requested:
            return  # stopped on purpose (drained, then shut down): not a failure
        logger.error("the engine died; stopping the server in %.0f s (exit code %d) so it is restarted",
                     ENGINE_DEATH_LINGER_S, ENGINE_DIED_EXIT_CODE)
        self.exit_code = ENGINE_DIED_EXIT_CODE
        await asyncio.sleep(ENGINE_DEATH_LINGER_S)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only hand work to the loop. Not recording the signal keeps
        # uvicorn from re-raising it after shutdown, so a drained server exits 0.
        if self._drain_requested or self._loop is None:
            self.force_exit = True
            self.should_exit = True
            return
        self._drain_requested = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        logger.info("%s received: draining (up to %.1f s); a second signal stops at once",
                    signal_name, self._drain_timeout_s)
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self._app.state.lifecycle.drain(self._engine, self._drain_timeout_s)
        except Exception:
            logger.exception("drain failed; stopping")
        finally:
            self.should_exit = True


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    security = getattr(app.state, "security", None)  # header/body timeouts and the connection cap
    return uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                          timeout_graceful_shutdown=GRACEFUL_CLOSE_S, lifespan="on",
                          **uvicorn_options(None if security is None else security.http))


def run_server(app: FastAPI, engine: EngineClient, sock: socket.socket, drain_timeout_s: float,
               log_level: str = "info") -> int:
    """Serve on an already bound socket until a signal; drain; return the exit code (0 after a drain,
    ENGINE_DIED_EXIT_CODE when the engine died)."""
    host, port = sock.getsockname()[:2]
    server = DrainingServer(uvicorn_config(app, host, port, log_level), app, engine, drain_timeout_s)
    server.run(sockets=[sock])
    if not server.started:
        return 1  # e.g. the port was taken; uvicorn logged why
    return server.exit_code


class BackgroundServer:
    """The app served by uvicorn in a daemon thread, on 127.0.0.1 and a free port by default.

    Use as a context manager: entering waits until the server accepts connections (and the engine
    started), leaving stops it (the engine shuts down with the app).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        # Bound here and handed to uvicorn, so no other process can take a port picked as free.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.app = app
        self.host = host
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, host, self.port, log_level))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name=f"sits-server-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited before it started")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start within {timeout_s} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
