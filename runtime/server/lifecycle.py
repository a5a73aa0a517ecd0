"""The server's life: accepting, draining, stopped; which API requests are in flight.

On SIGTERM the server drains: readiness turns false and new generation requests get 503 while
in-flight ones run to completion for up to `drain_timeout_s`; whatever still runs then is aborted
(its stream ends with finish_reason "abort") and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sits.runtime.engine.client import EngineClient

logger = logging.getLogger("sits.server")


class Lifecycle:
    """Counts in-flight API requests and the engine requests they own; drives the drain."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._engine_requests: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    def track(self, request_id: str) -> None:
        self._engine_requests.add(request_id)

    def untrack(self, request_id: str) -> None:
        self._engine_requests.discard(request_id)

    @property
    def engine_request_ids(self) -> list[str]:
        return sorted(self._engine_requests)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no API request is in flight within timeout_s."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    async def drain(self, engine: EngineClient, timeout_s: float, abort_grace_s: float = 5.0) -> int:
        """Stop accepting, let in-flight requests finish for timeout_s, abort the rest.

        Returns how many engine requests were aborted. Aborted streams still end cleanly (their
        last chunk has finish_reason "abort", then `data: [DONE]`); abort_grace_s bounds how long
        that takes before the server stops anyway.
        """
        started = time.monotonic()
        self.draining = True
        logger.info("draining: %d request(s) in flight, waiting up to %.1f s", self.in_flight, timeout_s)
        if await self.wait_idle(timeout_s):
            logger.info("drained in %.2f s", time.monotonic() - started)
            return 0
        leftover = self.engine_request_ids
        logger.warning("drain timeout: aborting %d request(s)", len(leftover))
        for request_id in leftover:
            await engine.abort(request_id)
        if not await self.wait_idle(abort_grace_s):
            logger.warning("%d request(s) still open after aborting; stopping anyway", self.in_flight)
        return len(leftover)
