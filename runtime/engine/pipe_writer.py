"""`PipeWriter`: the engine's messages to the server, written by the step loop itself without ever waiting.

The engine process writes one message per step. Handing each to a sender thread (as it did before) cost
the loop a thread wake-up and two GIL hand-offs per step, and on a busy CPU the woken thread often took the
loop's core: on 2 shared cores at 32 streams the engine process's threads were switched onto a core about 8
times per step (about 3 since). Yet the pipe almost always has room: the server's reader thread drains it
at once.

So the loop writes a message with one non-blocking `send` (`MSG_DONTWAIT`: the socket itself stays
blocking). Only when the socket's buffer is full (a server slow to read) does the rest of that message,
and every message after it until the backlog is written, go to a sender thread that writes them blocking,
in order. A step never waits on the server, and in the common case no other thread runs.

Framing: `multiprocessing.connection.Connection`'s (a 4-byte big-endian signed length, or -1 and an 8-byte
length above 2 GiB - 1), so the server keeps reading with `Connection.recv_bytes`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import struct
import threading
from multiprocessing.connection import Connection

logger = logging.getLogger("sits.engine_core")

_MAX_SHORT = 0x7FFFFFFF  # Connection's 4-byte length field; longer messages get -1 and an 8-byte length


def frame(data: bytes) -> bytes:
    """`data` with the length header `Connection.recv_bytes` reads."""
    n = len(data)
    if n > _MAX_SHORT:
        return struct.pack("!i", -1) + struct.pack("!Q", n) + data
    return struct.pack("!i", n) + data


class PipeWriter:
    """Writes whole messages to `conn` (a socket-backed `Connection`: `multiprocessing.Pipe(duplex=True)`
    on Unix) from one thread without blocking it; see the module docstring.

    Args:
        conn: the engine's end of the pipe; this writer sends on a duplicate of its descriptor, so the
            connection keeps its own for reading.
        name: the sender thread's name.
    """

    def __init__(self, conn: Connection, name: str = "sits-engine-core-sender") -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._lock = threading.Lock()  # guards _backlog and the order of what goes to the socket
        self._backlog = 0  # frames handed to the sender thread and not yet written
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._send_queued, name=name, daemon=True)
        self._thread.start()
        self.direct_writes = 0  # messages written whole by the caller (figures for tests and profiles)
        self.queued_writes = 0  # messages (or their rests) the sender thread wrote

    @property
    def backlog(self) -> int:
        """Messages handed to the sender thread and not yet written (0: the next write goes out directly)."""
        with self._lock:
            return self._backlog

    def write(self, data: bytes) -> None:
        """Send one message: now if the socket takes it whole, else in order through the sender thread.
        A server that is gone is not an error here (the receiver notices the pipe's end)."""
        message = frame(data)
        with self._lock:
            if self._closed:
                return
            if self._backlog == 0:
                try:
                    sent = self._sock.send(message, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:  # the server is gone
                    return
                if sent == len(message):
                    self.direct_writes += 1
                    return
                message = message[sent:]
            self._backlog += 1
            self.queued_writes += 1
        self._queue.put(message)

    def _send_queued(self) -> None:
        """The sender thread: what the socket could not take at once, written blocking, in order."""
        while (message := self._queue.get()) is not None:
            with contextlib.suppress(OSError):  # the server is gone: the receiver notices
                self._sock.sendall(message)
            with self._lock:
                self._backlog -= 1

    def close(self, timeout_s: float) -> None:
        """Write what is queued (waiting up to timeout_s for a server slow to read), then close."""
        with self._lock:
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the last engine batches were not written within %.0f s", timeout_s)
            with contextlib.suppress(OSError):  # unblocks the sender's sendall
                self._sock.shutdown(socket.SHUT_WR)
        self._sock.close()
