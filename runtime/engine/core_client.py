"""`MultiprocessEngineClient`: the server's side of the engine core process (`core_process.py`).

    engine = MultiprocessEngineClient.spawn(config, tenancy=tenancy)   # blocks until the engine is loaded
    app = build_app(engine, ...)                                       # an EngineClient like AsyncEngine

The server process never loads the weights: the child sends its tokenizer with its Ready message
(a model loaded with a custom tokenizer serves with that same tokenizer). Commands (add, abort,
LoRA, stops of completions a stop string ended, new tenant tables, shutdown) gathered during one
event-loop turn go out as one message; one reader thread receives the engine's per-step
`CoreBatch`es, unpickles them and hands each batch to the event loop in one call, where its token
deltas are fanned out to the requests' `RequestStream`s, which decode the text and apply stop
strings (`client_base.py`). The wire format and why pickle over a pipe: `core_wire.py` and
`core_process.py`.

Failure: if the engine process dies (killed, crashed), the pipe closes; the reader marks the
engine dead (`is_healthy` False: liveness 503), every stream that already got output ends with a
final snapshot whose unfinished completions have finish_reason "abort", every other one raises
`EngineDiedError` (a 500), and `wait_until_dead` returns so the server exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any

from sits.runtime.config import EngineConfig
from sits.runtime.engine import core_wire as wire
from sits.runtime.engine.client_base import StreamingClient
from sits.runtime.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineDiedError,
    EngineShuttingDownError,
)
from sits.runtime.engine.request_stream import RequestStream
from sits.runtime.engine.stats import EngineStats, StatsAnswers
from sits.runtime.engine.structured_output import GrammarCache
from sits.runtime.lora.config import LoraModule
from sits.runtime.lora.usage import AdapterUsage

logger = logging.getLogger("sits.engine_client")

STOP_TIMEOUT_S = 30.0  # after the drain, how long the engine process may take to exit before it is killed
# Added to the niceness of the thread that runs the server's event loop (HTTP, detokenization, SSE):
# `_yield_to_the_engine`.
EVENT_LOOP_NICENESS = 10


class EngineStartError(Exception):
    """The engine process could not load the model; `user_error`: a bad model or option (exit 2)."""

    def __init__(self, message: str, user_error: bool) -> None:
        super().__init__(message)
        self.user_error = user_error


class MultiprocessEngineClient(StreamingClient):
    """The engine in a child process, as an `EngineClient` (see the module docstring).

    Args:
        process: the started engine process.
        conn: the server's end of the pipe.
        ready: what the engine said once loaded.
        tenancy: the server's `Tenancy` (tables go to the engine, its figures come back), or None.
    """

    def __init__(self, process: Any, conn: Connection, ready: wire.Ready, tenancy: Any = None) -> None:
        self._process = process
        self._conn = conn
        self._ready = ready
        self._adopt(ready.facts)
        self._tenancy = tenancy
        self.lora_usage = AdapterUsage()
        self._lora_modules = dict(ready.lora_modules)
        self._room = ready.room
        self._stats = StatsAnswers(ready.stats)  # asks answered by the engine process between steps
        self._tenancy_usage: Any = None
        self._streams: dict[str, RequestStream] = {}  # event-loop only
        self._calls: dict[int, asyncio.Future] = {}  # LoRA calls awaiting the engine's answer
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # guards _outbox and _flush_scheduled
        self._send_lock = threading.Lock()
        self._outbox: list = []
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._healthy = True
        self._accepting = True
        self._stopping = False  # an orderly shutdown: the pipe closing then is no death
        self._stopped = threading.Event()
        self._death_waiters: list[asyncio.Future] = []
        self._grammars: GrammarCache | None = None
        self.event_loop_niceness = EVENT_LOOP_NICENESS  # 0: leave the event loop's priority alone
        if tenancy is not None:
            from sits.runtime.tenancy.engine_side import EngineTenancyUsage

            self._tenancy_usage = EngineTenancyUsage()
            tenancy.use_remote_engine(lambda: self._tenancy_usage, lambda table: self._send(wire.NewTenantTable(table)))

    @classmethod
    def spawn(cls, config: EngineConfig, *, tenancy: Any = None, log_level: str = "info") -> MultiprocessEngineClient:
        """Start the engine process and wait until it has loaded the model (call from the main thread:
        the child's parent-death signal follows the thread that started it).

        Raises:
            EngineStartError: the engine could not be built (its one-line reason).
        """
        from sits.runtime.engine.core_entry import run_engine_core

        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        spec = tenancy.engine_spec() if tenancy is not None else None
        process = context.Process(target=run_engine_core, args=(theirs, config, spec, os.getpid(), log_level),
                                  name="sits-engine-core", daemon=False)  # daemons cannot start TP workers
        process.start()
        theirs.close()  # only the child holds its end now: its death is our EOF
        try:
            ready = _wait_ready(process, ours)
        except BaseException:
            ours.close()
            _stop_process(process, 5.0)
            raise
        logger.info("engine process %d ready", process.pid)
        return cls(process, ours, ready, tenancy)

    # -- facts -----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    @property
    def lora_modules(self) -> dict[str, LoraModule]:
        return dict(self._lora_modules)

    @property
    def is_healthy(self) -> bool:
        return self._healthy

    def max_tokens_for(self, tenant: str) -> int:
        return self._room.max_tokens_for(tenant)

    def stats(self) -> EngineStats:
        """The engine's figures now: asks the engine process, which answers before its next step (this
        waits for the step in flight, STATS_WAIT_S at most); the latest figures it sent when it cannot
        answer (not started, stopping, gone). Any thread; the answer never needs the event loop."""
        if self._reader is None or not self._healthy or self._stopping:
            return self._stats.latest
        ticket = self._stats.ask()
        with self._lock:  # what was queued before this ask reaches the engine before it
            commands, self._outbox = self._outbox, []
        try:
            self._write([*commands, wire.StatsRequest(ticket)])
        except (OSError, ValueError):  # the engine is gone: the reader reports it
            return self._stats.latest
        return self._stats.wait(ticket)

    @property
    def grammar_cache(self) -> GrammarCache:
        """This process's own cache: the server compiles here for the 400 of a grammar xgrammar refuses
        (`sits.runtime.server.grammar_compiler`); the engine process compiles the same spec again off its
        step loop when the request arrives (compiled grammars do not pickle)."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.vocab_size)
        return self._grammars

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the reader thread on this event loop (idempotent)."""
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="sits-engine-client-reader", daemon=True)
        self._reader.start()
        _yield_to_the_engine(self.event_loop_niceness)
        self._flush_soon()

    async def wait_until_dead(self) -> None:
        if not self._healthy:
            return
        future = asyncio.get_running_loop().create_future()
        self._death_waiters.append(future)
        await future

    async def shutdown(self, drain_timeout_s: float = 0) -> None:
        """Stop accepting; the engine finishes what runs for up to drain_timeout_s, aborts the rest
        (those streams end with finish_reason "abort") and exits."""
        self._accepting = False
        self._stopping = True
        if self._healthy and self._process.is_alive():
            self._send(wire.Shutdown(drain_timeout_s))
            await asyncio.to_thread(self._stopped.wait, drain_timeout_s + STOP_TIMEOUT_S)
        await asyncio.to_thread(self.close)

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Make sure the engine process is gone (blocking; also when the server never started)."""
        self._stopping = True
        self._accepting = False
        if self._process.is_alive() and not self._stopped.is_set():
            with contextlib.suppress(OSError, ValueError):
                self._write([wire.Shutdown(0.0)])
        _stop_process(self._process, timeout_s)
        self._conn.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout_s)

    # -- requests --------------------------------------------------------------------------
    def _submit(self, stream: RequestStream, *, priority: int, cache_salt: str | None, lora: str | None) -> None:
        """Bad requests are refused by the engine process and raised at the stream's first output."""
        if not self._healthy:
            raise EngineDeadError("the engine process died and accepts no requests")
        if not self._accepting:
            raise EngineShuttingDownError("the engine is shutting down and accepts no new requests")
        if stream.request_id in self._streams:
            raise DuplicateRequestError(f"request id {stream.request_id!r} is already in the engine")
        self.lora_usage.enter(lora)  # InvalidRequestError while the adapter is being unloaded
        self._streams[stream.request_id] = stream
        self._send(wire.AddRequest(stream.request_id, stream.prompt_token_ids, stream.params, stream.tenant,
                                   priority, cache_salt, stream.stream_text, lora))

    def _release(self, stream: RequestStream, lora: str | None) -> None:
        self._streams.pop(stream.request_id, None)
        self.lora_usage.leave(lora)
        if not stream.done and self._healthy:
            self._send(wire.AbortRequests([stream.request_id]))

    def _stop_completions(self, request_id: str, indices: list[int]) -> None:
        self._send(wire.StopCompletions(request_id, indices))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._send(wire.AbortRequests(ids))

    async def load_lora(self, module: LoraModule) -> None:
        await self._call(lambda call_id: wire.LoadLora(call_id, module))

    async def unload_lora(self, name: str) -> None:
        await self._call(lambda call_id: wire.UnloadLora(call_id, name))

    async def _call(self, command: Any) -> None:
        if not self._healthy:
            raise EngineDeadError("the engine process died")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(command(call_id))
        await future

    # -- sending ---------------------------------------------------------------------------
    def _send(self, command: Any) -> None:
        """Queue a command; everything queued in one event-loop turn goes out as one message."""
        with self._lock:
            self._outbox.append(command)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        self._flush_soon()

    def _flush_soon(self) -> None:
        loop = self._loop
        if loop is None:
            return  # before start: sent when the reader starts
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is being stopped
            loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            commands, self._outbox = self._outbox, []
            self._flush_scheduled = False
        if commands:
            with contextlib.suppress(OSError, ValueError):  # the engine is gone: the reader reports it
                self._write(commands)

    def _write(self, commands: list) -> None:
        data = wire.encode(commands)
        with self._send_lock:
            self._conn.send_bytes(data)

    # -- receiving -------------------------------------------------------------------------
    def _read(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                batch = wire.decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            if batch.stats is not None:  # answered on this thread: stats() may be blocking the event loop
                self._stats.answer(batch.stats_ticket, batch.stats)
                continue
            if batch.stopped:
                self._stopped.set()
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone already
                loop.call_soon_threadsafe(self._dispatch, batch)
        self._stats.close()
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._on_lost)

    def _dispatch(self, batch: wire.CoreBatch) -> None:
        """On the event loop: one step's outputs to their streams, and the engine's figures."""
        self._fan_out(map(wire.decode_output, batch.outputs))
        for request_id, error in batch.errors:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.fail(wire.error_from_wire(error))
        for result in batch.results:
            self._lora_modules = result.lora_modules
            future = self._calls.pop(result.call_id, None)
            if future is not None and not future.done():
                if result.error is None:
                    future.set_result(None)
                else:
                    future.set_exception(wire.error_from_wire(result.error))
        self._room = batch.room or self._room
        if batch.tenancy_usage is not None:
            self._tenancy_usage = batch.tenancy_usage
        if batch.eviction_index is not None and self._tenancy is not None:
            self._tenancy.store.publish_eviction_index(batch.eviction_index)
        if batch.kv_state is not None and self._tenancy is not None:
            self._tenancy.store.publish_kv_state(batch.kv_state)

    def _on_lost(self) -> None:
        """On the event loop: the pipe closed. Expected after a shutdown; otherwise the engine died."""
        self._stopped.set()
        if self._stopping:
            for stream in self._streams.values():
                stream.abort()
            return
        code = self._process.exitcode
        if code is None:
            self._process.join(1.0)
            code = self._process.exitcode
        logger.error("the engine process %s exited unexpectedly (exit code %s); failing %d request(s) in flight",
                     self._process.pid, code, len(self._streams))
        self._healthy = False
        self._accepting = False
        error = f"the engine process died (exit code {code}) while serving this request"
        for stream in self._streams.values():
            if stream.received:
                stream.abort()
            else:
                stream.fail(EngineDiedError(error))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDiedError("the engine process died"))
        self._calls.clear()
        for waiter in self._death_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._death_waiters.clear()


def _wait_ready(process: Any, conn: Connection) -> wire.Ready:
    """The engine's Ready message; EngineStartError if it says it failed or dies first."""
    while not conn.poll(0.2):
        if not process.is_alive():
            if conn.poll(0):  # it said why just before exiting
                break
            raise EngineStartError(f"the engine process exited with code {process.exitcode} while loading "
                                   "the model (see the log above)", user_error=False)
    try:
        message = wire.decode(conn.recv_bytes())
    except (EOFError, OSError):
        process.join(5.0)
        raise EngineStartError(f"the engine process exited with code {process.exitcode} while loading the model "
                               "(see the log above)", user_error=False) from None
    if isinstance(message, wire.StartFailed):
        process.join(5.0)
        raise EngineStartError(message.message, message.user_error)
    return message


def _stop_process(process: Any, timeout_s: float) -> None:
    """Join the process; kill it if it does not exit in time (it ignores SIGTERM)."""
    process.join(timeout_s)
    if process.is_alive():
        logger.warning("the engine process %s did not exit in %.0f s; killing it", process.pid, timeout_s)
        process.kill()
        process.join(5.0)


def _yield_to_the_engine(niceness: int) -> None:
    """Lower the calling thread's CPU priority (Linux: niceness is per thread) by `niceness`.

    When the server and the engine process want more CPU than there is (a small CPU, a pod's CPU
    limit), the engine's step loop, which every stream waits on, then gets the CPU first, and the
    event loop falls behind instead: its streams' chunks then merge the steps they missed
    (`RequestStream`), so each chunk carries more tokens and the server's work per token drops.
    Measured on 2 shared cores at 128 streams (`benchmarks/bench_served_vs_offline.py`): the API
    process's CPU per output token fell from 0.10 ms to 0.05 ms and served throughput went from
    0.25-0.56x of offline to 0.90-0.93x, at the price of coarser chunks (ITL p50 0.09 s -> 0.4-0.5 s,
    each chunk carrying ~13 tokens); niceness 5 was not enough to change either. With CPU to spare
    nothing changes. The reader thread, started before, keeps its priority, so the engine's batches
    are still read at once.
    """
    if niceness <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + niceness)
    except (OSError, AttributeError):  # not permitted here: the server runs as it is
        logger.debug("could not lower the event loop's priority", exc_info=True)
