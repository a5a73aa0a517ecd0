"""Command channels between the engine's rank and its workers.

Spawned workers get one pipe each: an idle worker blocks in `recv` without any timeout, sees the
engine's exit as end-of-file, and a dead worker is noticed through its process sentinel. Under
torchrun there are no pipes: commands are broadcast and replies gathered over a gloo group whose
timeout outlasts any idle spell (torchrun itself stops every rank when one fails).
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch.distributed as dist

from sits.runtime.parallel.commands import Failure, Reply, WorkerFailedError


class CommandChannel(ABC):
    """Rank 0's end: send a command to every worker, collect one reply from each."""

    @abstractmethod
    def send(self, command: Any) -> None:
        """Send to every worker. Raises WorkerFailedError if a worker is gone."""

    @abstractmethod
    def replies(self, timeout_s: float) -> list[Any]:
        """Each worker's reply payload, in rank order. Raises WorkerFailedError on a failure or timeout."""

    @abstractmethod
    def close(self) -> None:
        """Release the channel's resources."""


class WorkerEndpoint(ABC):
    """A worker's end."""

    @abstractmethod
    def recv(self) -> Any:
        """The next command (blocks). Raises EOFError when rank 0 is gone."""

    @abstractmethod
    def reply(self, payload: Any = None) -> None:
        """Answer the current command."""

    @abstractmethod
    def fail(self, failure: Failure) -> None:
        """Tell rank 0 why this worker stops (best effort)."""


class PipeCommandChannel(CommandChannel):
    """Pipes to spawned worker processes (ranks 1..N-1, in order)."""

    def __init__(self, connections: list[connection.Connection], processes: list[BaseProcess]) -> None:
        self.connections = connections
        self.processes = processes

    def send(self, command: Any) -> None:
        for conn in self.connections:
            try:
                conn.send(command)
            except (OSError, EOFError) as exc:
                raise self.failure(wait_s=1.0) or WorkerFailedError(f"a tensor-parallel worker is gone: {exc}") from exc

    def replies(self, timeout_s: float) -> list[Any]:
        pending = dict(enumerate(self.connections))
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerFailedError(f"tensor-parallel workers did not answer within {timeout_s:.0f} s")
            waitables = list(pending.values()) + [self.processes[i].sentinel for i in pending]
            ready = connection.wait(waitables, timeout=left)
            for index, conn in list(pending.items()):
                if conn in ready:
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        raise self.failure(wait_s=1.0) or WorkerFailedError("a tensor-parallel worker closed its pipe") from None
                    if isinstance(message, Failure):
                        raise _failure_error(message)
                    answers[index] = message.payload if isinstance(message, Reply) else message
                    del pending[index]
                elif self.processes[index].sentinel in ready:
                    raise self.failure(wait_s=1.0) or WorkerFailedError("a tensor-parallel worker exited")
        return [answers[i] for i in sorted(answers)]

    def failure(self, wait_s: float = 0.0) -> WorkerFailedError | None:
        """The error of the first failed worker (its own report if it sent one), or None if all live.

        Waits up to wait_s seconds for a worker that is on its way out to finish dying.
        """
        deadline = time.monotonic() + wait_s
        while True:
            for rank, (conn, process) in enumerate(zip(self.connections, self.processes, strict=True), start=1):
                if process.is_alive():
                    continue
                report = _last_failure(conn)
                if report is not None:
                    return _failure_error(report)
                return WorkerFailedError(f"tensor-parallel worker rank {rank} exited with {describe_exit(process.exitcode)}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()


class PipeWorkerEndpoint(WorkerEndpoint):
    def __init__(self, rank: int, conn: connection.Connection) -> None:
        self.rank = rank
        self.conn = conn

    def recv(self) -> Any:
        return self.conn.recv()

    def reply(self, payload: Any = None) -> None:
        self.conn.send(Reply(self.rank, payload))

    def fail(self, failure: Failure) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.conn.send(failure)


class GroupCommandChannel(CommandChannel):
    """Commands over a gloo group (torchrun). Rank 0 is the source of every broadcast."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, command: Any) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)

    def replies(self, timeout_s: float) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.gather_object(None, gathered, dst=0, group=self.group)
        return [message.payload if isinstance(message, Reply) else message for message in gathered[1:]]

    def close(self) -> None:
        """Nothing to release: the group goes with the process group."""


class GroupWorkerEndpoint(WorkerEndpoint):
    def __init__(self, rank: int, group: dist.ProcessGroup) -> None:
        self.rank = rank
        self.group = group

    def recv(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def reply(self, payload: Any = None) -> None:
        dist.gather_object(Reply(self.rank, payload), None, dst=0, group=self.group)

    def fail(self, failure: Failure) -> None:
        """Nothing to send: torchrun sees this rank exit and stops the others."""


def _failure_error(report: Failure) -> WorkerFailedError:
    return WorkerFailedError(f"tensor-parallel worker rank {report.rank} failed: {report.error}")


def _last_failure(conn: connection.Connection) -> Failure | None:
    """A Failure a dead worker left in its pipe, if any (reads without blocking)."""
    report = None
    with contextlib.suppress(EOFError, OSError):
        while conn.poll():
            message = conn.recv()
            if isinstance(message, Failure):
                report = message
    return report


def describe_exit(code: int | None) -> str:
    """A process's exit in words, from multiprocessing's exit code: N >= 0 "exit code N", -N the signal N
    ("signal SIGKILL"), None "exit code unknown"."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
