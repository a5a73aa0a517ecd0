"""A Redis connection that knows whether Redis is up, and the background task that writes to it.

The link never lets an outage reach the serving path: a failed call marks it down (logged once
per outage), the serving path then decides from local state, and a background task reconnects
with exponential backoff, has the owner write its whole local state back, and only then reports
up again (logged once). While up, the same task calls the owner's batched flush every interval,
or sooner when woken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sits.runtime.tasks import cancel_and_wait
from sits.runtime.tenancy.state_store import redact_url

log = logging.getLogger("sits.runtime.tenancy.redis_store")

UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True)
class LinkTiming:
    """The link's clocks, in seconds.

    Attributes:
        flush_interval_s: how often the owner's pending writes are flushed while up.
        op_timeout_s: connect and read timeout of each call. No client-side retries: a failure
            must surface at once so the caller can fall back to local state.
        backoff_initial_s, backoff_max_s: reconnection attempts back off exponentially between these.
    """

    flush_interval_s: float = 0.5
    op_timeout_s: float = 0.5
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0


class RedisLink:
    """One redis.asyncio client plus up/down state and the writer task.

    Args:
        url: redis://[:password@]host:port/db (or rediss://, unix://); logged with the password hidden.
        flush: the owner's batched write (raises on failure; the link classifies the error).
        write_back: rewrites all the owner's local state; run before the link reports up.
        timing: flush interval, call timeout and reconnection backoff.
    """

    def __init__(self, url: str, flush: Callable[[], Awaitable[None]], write_back: Callable[[], Awaitable[None]],
                 timing: LinkTiming) -> None:
        self.url = redact_url(url)
        self.client = aioredis.Redis.from_url(url, socket_timeout=timing.op_timeout_s,
                                              socket_connect_timeout=timing.op_timeout_s,
                                              retry=Retry(NoBackoff(), 0), decode_responses=True)
        self.timing = timing
        self._flush = flush
        self._write_back = write_back
        self.up = False
        self._down_logged = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def start(self, started_message: str) -> None:
        """Connect once (an outage is logged, not raised) and start the writer task."""
        if self._task is not None:
            return
        try:
            await self.client.ping()
            await self._write_back()
            self._mark_up()
            log.info("%s", started_message)
        except UNREACHABLE as error:
            self.mark_down(error)
        self._task = asyncio.create_task(self._run(), name="sits-state-store")

    async def stop(self) -> None:
        # The flag ends the writer even if a cancellation gets lost in a wait that completes at the
        # same moment, so closing never hangs.
        self._stopping = True
        self._wake.set()
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def aclose(self) -> None:
        self.up = False
        await self.client.aclose()

    def wake(self) -> None:
        """Flush before the interval ends (the pending writes are piling up)."""
        self._wake.set()

    def mark_down(self, error: BaseException) -> None:
        if not self._down_logged:  # once per outage, including an outage at start
            log.warning("state store %s is unreachable (%s); serving from local state until it returns",
                        self.url, type(error).__name__)
            self._down_logged = True
        self.up = False

    def _mark_up(self) -> None:
        self.up = True
        self._down_logged = False

    async def flush(self) -> None:
        """The owner's flush now, if up; an outage marks the link down instead of raising."""
        if not self.up:
            return
        try:
            await self._flush()
        except UNREACHABLE as error:
            self.mark_down(error)
        except RedisError as error:  # not an outage: the writes stay pending; say why
            log.warning("state store %s: batched write failed: %s", self.url, error)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the writes for good
                log.exception("state store %s: background writer failed; restarting it", self.url)
                await asyncio.sleep(self.timing.backoff_max_s)

    async def _loop(self) -> None:
        backoff = self.timing.backoff_initial_s
        while not self._stopping:
            if self.up:
                # asyncio.timeout, unlike wait_for on Python 3.11, never swallows a cancellation.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.timing.flush_interval_s):
                        await self._wake.wait()
                self._wake.clear()
                if self._stopping:
                    return
                await self.flush()
                continue
            await asyncio.sleep(backoff)
            try:
                # Pooled connections died with the old server: drop them all, or each would fail
                # once more after the reconnect and flap the link down again.
                await self.client.connection_pool.disconnect()
                await self.client.ping()
                await self._write_back()
            except UNREACHABLE:
                backoff = min(backoff * 2, self.timing.backoff_max_s)
                continue
            except RedisError as error:
                log.warning("state store %s: write-back failed: %s", self.url, error)
                backoff = min(backoff * 2, self.timing.backoff_max_s)
                continue
            backoff = self.timing.backoff_initial_s
            self._mark_up()
            log.warning("state store %s is reachable again; local state written back", self.url)
