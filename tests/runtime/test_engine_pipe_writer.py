"""The engine process's non-blocking pipe writer: Connection-compatible frames, never a blocked caller, order kept."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from sits.runtime.engine.pipe_writer import PipeWriter, frame


@pytest.fixture
def pipe():
    ours, theirs = multiprocessing.Pipe(duplex=True)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_frames_are_read_by_connection_recv_bytes(pipe) -> None:
    engine_end, server_end = pipe
    writer = PipeWriter(engine_end)
    messages = [b"", b"x", b"step" * 100, bytes(range(256)) * 300]  # 0 B, 1 B, 400 B, 76.8 KB (two frames' paths)
    for message in messages:
        writer.write(message)
    assert [server_end.recv_bytes() for _ in messages] == messages
    assert writer.direct_writes >= 3  # the small ones fit the socket's buffer whole
    writer.close(5.0)
    # the engine's end still reads (the writer sent on a duplicate of its descriptor)
    server_end.send_bytes(b"command")
    assert engine_end.recv_bytes() == b"command"


def test_the_caller_never_waits_for_a_server_that_does_not_read(pipe) -> None:
    engine_end, server_end = pipe
    writer = PipeWriter(engine_end)
    messages = [bytes([i]) * 256_000 for i in range(40)]  # 10 MB: far more than a socket buffer holds
    caller = threading.Thread(target=lambda: [writer.write(message) for message in messages], daemon=True)
    caller.start()
    caller.join(10.0)
    assert not caller.is_alive()  # it returned with nothing read: no write waited on the reader
    assert writer.queued_writes > 0  # the socket filled up: the rest went to the sender thread
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.extend(server_end.recv_bytes() for _ in messages))
    reader.start()
    writer.close(30.0)
    reader.join(30.0)
    assert received == messages  # whole, in order, although written partly by each thread


def test_after_a_backlog_drains_writes_are_direct_again(pipe) -> None:
    engine_end, server_end = pipe
    writer = PipeWriter(engine_end)
    big = [bytes([i]) * 500_000 for i in range(8)]
    for message in big:
        writer.write(message)
    queued = writer.queued_writes
    assert queued > 0
    assert [server_end.recv_bytes() for _ in big] == big
    deadline = time.monotonic() + 10.0
    while writer.backlog and time.monotonic() < deadline:  # the sender thread finishes its last write
        time.sleep(0.01)
    direct = writer.direct_writes
    writer.write(b"next step")
    assert server_end.recv_bytes() == b"next step"
    assert (writer.direct_writes, writer.queued_writes) == (direct + 1, queued)
    writer.close(5.0)


def test_a_server_that_is_gone_is_not_an_error(pipe) -> None:
    engine_end, server_end = pipe
    writer = PipeWriter(engine_end)
    server_end.close()
    for _ in range(3):
        writer.write(b"x" * 300_000)  # EPIPE / ECONNRESET: dropped, the receiver notices the pipe's end
    writer.close(5.0)


def test_frame_header_matches_multiprocessing() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
