"""Asyncio task handling shared by the server, the router and the tenancy: cancelling a task and
waiting for its end, racing work against a watcher (a client that leaves), and background work
that repeats every interval (the one home of the polling loops).

The router's health probes, EndpointSlice listings and KV-state reads, and the replicas' tenant-table
polls all run one coroutine every `interval_s` seconds in a named task that closing cancels. Errors
are the step's business: a step that raises ends its task (each step logs and swallows the failures
it expects, so one that escapes is a bug that should surface).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` (None: nothing to do) and wait until it has ended; its cancellation is not re-raised."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def wait_first(task: asyncio.Future[Any], watcher: asyncio.Future[Any]) -> None:
    """Wait until `task` or `watcher` ends, then cancel the watcher, and the task when it has not
    ended (waiting until it has, so nothing it holds outlives this call). `task.cancelled()` then
    tells which came first. A cancellation of this call does the same before it propagates."""
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class PeriodicTask:
    """Awaits `step()` every `interval_s` seconds in a background task, from `start()` until `stop()`.

    Args:
        step: the coroutine function run each round.
        interval_s: seconds slept between the end of one round and the start of the next.
        name: the asyncio task's name (it shows in task dumps).
        run_first: run a round as soon as the task starts (True) or only after the first interval
            (False: the owner usually ran the first round itself, awaited, before starting).
    """

    def __init__(self, step: Callable[[], Awaitable[object]], interval_s: float, name: str, *,
                 run_first: bool = False) -> None:
        self._step = step
        self.interval_s = interval_s
        self._name = name
        self._run_first = run_first
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the rounds (on the running event loop); a second call while running does nothing."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._name)

    async def start_after_round(self) -> None:
        """Run one round now, awaited (the owner starts from fresh state: the replicas probed, the
        Services listed), then start the background rounds."""
        await self._step()
        self.start()

    async def stop(self) -> None:
        """Cancel the rounds and wait until the task has ended; start() may then run them again."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        if self._run_first:
            await self._step()
        while True:
            await asyncio.sleep(self.interval_s)
            await self._step()
