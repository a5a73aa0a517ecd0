"""sits.runtime.tasks: the polling loop's rounds and stop, and racing work against a watcher."""

from __future__ import annotations

import asyncio

from sits.runtime.tasks import PeriodicTask, cancel_and_wait, wait_first


class Rounds:
    """A step that counts its rounds and sets `reached` at the `wanted`-th."""

    def __init__(self, wanted: int) -> None:
        self.count = 0
        self.wanted = wanted
        self.reached = asyncio.Event()

    async def step(self) -> None:
        self.count += 1
        if self.count == self.wanted:
            self.reached.set()


async def rounds_until_stopped() -> None:
    rounds = Rounds(3)
    task = PeriodicTask(rounds.step, 0.0, "test-rounds")
    task.start()
    task.start()  # a second start while running does nothing
    assert task.running
    await asyncio.wait_for(rounds.reached.wait(), 10)
    await task.stop()
    assert not task.running
    stopped_at = rounds.count
    await asyncio.sleep(0)
    assert rounds.count == stopped_at  # no round after stop() returned
    task.start()  # and it starts again
    assert task.running
    await task.stop()


async def first_round_at_once_or_after_an_interval() -> None:
    rounds = Rounds(1)
    later = PeriodicTask(rounds.step, 3600.0, "test-later")
    later.start()
    await asyncio.sleep(0)
    assert rounds.count == 0  # waits an interval (an hour) first
    await later.stop()
    first = PeriodicTask(rounds.step, 3600.0, "test-first", run_first=True)
    first.start()
    await asyncio.wait_for(rounds.reached.wait(), 10)
    await first.stop()
    awaited = PeriodicTask(rounds.step, 3600.0, "test-awaited")
    await awaited.start_after_round()
    assert rounds.count == 2 and awaited.running  # the round ran before start_after_round returned
    await awaited.stop()


async def watcher_first_cancels_the_work() -> None:
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    leave = asyncio.Event()
    task, watcher = asyncio.ensure_future(work()), asyncio.ensure_future(leave.wait())
    leave.set()
    await wait_first(task, watcher)
    assert task.cancelled() and cleaned.is_set()  # the work ended before wait_first returned
    done, still = asyncio.ensure_future(asyncio.sleep(0, "result")), asyncio.ensure_future(asyncio.Event().wait())
    await wait_first(done, still)
    assert done.result() == "result"
    await asyncio.sleep(0)
    assert still.cancelled()


async def cancelled_and_awaited() -> None:
    task = asyncio.ensure_future(asyncio.Event().wait())
    await cancel_and_wait(task)
    assert task.cancelled()
    await cancel_and_wait(None)


def test_periodic_task_runs_rounds_until_stopped_and_can_start_again():
    asyncio.run(rounds_until_stopped())


def test_a_first_round_at_once_in_the_task_or_awaited_or_after_an_interval():
    asyncio.run(first_round_at_once_or_after_an_interval())


def test_wait_first_cancels_the_work_when_the_watcher_ends_first():
    asyncio.run(watcher_first_cancels_the_work())


def test_cancel_and_wait_ends_a_task_and_ignores_none():
    asyncio.run(cancelled_and_awaited())
