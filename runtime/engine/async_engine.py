"""`AsyncEngine`: the step loop on a background thread, outputs delivered to asyncio streams.

Model steps block for milliseconds to seconds, so they run on one dedicated thread that owns the
`LLMEngine`; the event loop never touches it. Client calls become commands (add, abort, stop a
completion a stop string ended) queued under a lock; the thread applies them between steps, runs a
step, and hands the step's token deltas to the consumers' event loop in one
`loop.call_soon_threadsafe` call, where the requests' `RequestStream`s decode them and apply stop
strings (`client_base.py`: the same code as for the engine process). With nothing to do the thread
sleeps on a condition variable (no polling) until a command arrives.

Stats are built on the same thread, only when asked: `stats()` hands the loop a ticket and waits
for the figures it builds after the step in flight (`StatsAnswers`); no step builds any otherwise.

Periodic work that must read engine state on its own thread (the tenancy layer publishing its
eviction index) is registered with `add_periodic`: it runs between steps when due, and once more
when the engine goes idle, never while a step runs.

Failure handling: if a step raises, every in-flight stream fails with `EngineError`, the engine is
marked unhealthy (`is_healthy` False) and new requests get `EngineDeadError`; nothing hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sits.runtime.config import EngineConfig
from sits.runtime.engine.client_base import EngineFacts, StreamingClient
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineError,
    EngineShuttingDownError,
)
from sits.runtime.engine.request import RequestOutput, SamplingParams
from sits.runtime.engine.request_stream import RequestStream
from sits.runtime.engine.stats import EngineStats, StatsAnswers
from sits.runtime.engine.structured_output import GrammarCache, StructuredOutputs
from sits.runtime.lora.config import LoraConfigError, LoraModule
from sits.runtime.lora.manager import LoraManager, lora_slot
from sits.runtime.lora.usage import AdapterUsage

logger = logging.getLogger(__name__)

_BACK_OFF_S = 0.05  # wait after a step that could schedule nothing


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    priority: int
    cache_salt: str | None = None
    stream_text: bool = True
    lora: str | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Stop:  # completions a stop string ended in the client (`LLMEngine.stop_completions`)
    request_id: str
    indices: list[int]


@dataclass
class _Call:  # run on the engine thread between steps (call_between_steps)
    function: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


_Command = _Add | _Abort | _Stop | _Call


@dataclass
class _Periodic:
    """A callback run on the engine thread every interval_s while the engine state changes."""

    callback: Callable[[], None]
    interval_s: float
    next_at: float = 0.0
    dirty: bool = False  # the engine changed since the last run


class AsyncEngine(StreamingClient):
    """An `LLMEngine` served to asyncio code, in this process (an `EngineClient`).

    Args:
        engine: the engine; from now on only the background thread calls it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        engine.output_processor.detokenize = False  # the streams decode the text and apply stop strings
        self._adopt(EngineFacts.of(engine))
        self._cond = threading.Condition()
        self._commands: list[_Command] = []
        self._streams: dict[str, RequestStream] = {}  # guarded by _cond
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # request_id -> its consumer's loop; under _cond
        self.lora_usage = AdapterUsage()  # requests in flight per LoRA adapter (runtime unloads)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._accepting = True
        self._healthy = True
        self._idle = threading.Event()  # set while the engine holds no request
        self._idle.set()
        self._stats = StatsAnswers(engine.stats())  # asks answered by the loop between steps
        self._loop_done = False  # guarded by _cond: the loop thread answers no more asks
        self._periodic: list[_Periodic] = []
        self._death_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []  # guarded by _cond

    @classmethod
    def from_config(cls, config: EngineConfig, *, progress: bool = True, **hooks: Any) -> AsyncEngine:
        """Load the model and build the engine; `hooks` as for `LLMEngine` (eviction policy, queues)."""
        return cls(LLMEngine.from_config(config, progress=progress, **hooks))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> AsyncEngine:
        return cls(engine)

    # -- read-only facts -------------------------------------------------------------------
    @property
    def loaded_model(self):
        """The LoadedModel (device, dtype, source) the engine serves."""
        return self.engine.loaded_model

    @property
    def lora_modules(self) -> dict[str, LoraModule]:
        """The LoRA adapters served (name -> module), empty without --enable-lora."""
        return dict(self.engine.lora.modules) if self.engine.lora is not None else {}

    @property
    def grammar_cache(self) -> GrammarCache:
        """The engine's own grammar cache (thread-safe): what the server compiles, its thread finds."""
        return self.engine.structured_outputs.cache

    @property
    def structured_outputs(self) -> StructuredOutputs:
        """The engine's grammar cache and matchers (its cache is safe to use from any thread)."""
        return self.engine.structured_outputs

    def max_tokens_for(self, tenant: str) -> int:
        """The longest sequence `tenant` can hold in the KV cache, in tokens (its shard's room)."""
        return self.engine.kv_cache.max_tokens_for(tenant)

    @property
    def is_healthy(self) -> bool:
        """False once a step crashed or the loop stopped unexpectedly."""
        return self._healthy and (self._thread is None or self._thread.is_alive() or self._stop)

    def stats(self) -> EngineStats:
        """The engine's figures now: built by the loop thread after the step in flight (this waits
        for it, STATS_WAIT_S at most: then the latest figures built), or here when no loop runs."""
        with self._cond:
            if self._thread is None or self._loop_done:  # nothing else touches the engine (the lock holds off a start)
                stats = self.engine.stats()
                self._stats.answer(0, stats)
                return stats
            ticket = self._stats.ask()
            self._cond.notify()
        return self._stats.wait(ticket)

    def add_periodic(self, callback: Callable[[], None], interval_s: float) -> None:
        """Run `callback` on the engine thread about every interval_s seconds while requests
        change the engine's state, and once when it goes idle. It may read engine state (no step
        runs meanwhile) and must be quick; its errors are logged, never raised. Register before
        the first request."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._periodic.append(_Periodic(callback, interval_s))

    async def wait_until_dead(self) -> None:
        """Return once a step crashed (never after an orderly shutdown)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            if not self._healthy:
                return
            self._death_waiters.append((loop, future))
        await future

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the step loop thread (idempotent)."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sits-engine-loop", daemon=True)
                self._thread.start()

    async def shutdown(self, drain_timeout_s: float = 0) -> None:
        """Stop accepting requests, let in-flight ones finish for up to drain_timeout_s seconds,
        abort the rest (their streams end with finish_reason "abort"), then stop the thread."""
        self._accepting = False
        if self._thread is None:
            self.engine.shutdown()
            return
        if drain_timeout_s > 0:
            await asyncio.to_thread(self._idle.wait, drain_timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)
        self.engine.shutdown()

    # -- requests --------------------------------------------------------------------------
    def _submit(self, stream: RequestStream, *, priority: int, cache_salt: str | None, lora: str | None) -> None:
        if not self._healthy:
            raise EngineDeadError("the engine stopped after an error and accepts no requests")
        if not self._accepting:
            raise EngineShuttingDownError("the engine is shutting down and accepts no new requests")
        request_id = stream.request_id
        lora_slot(self.engine.lora, lora)  # an adapter not served: InvalidRequestError, before queueing
        self._ensure_started()
        with self._cond:  # re-checked under the lock: a crash or shutdown may have just happened
            if not self._healthy:
                raise EngineDeadError("the engine stopped after an error and accepts no requests")
            if not self._accepting or self._stop:
                raise EngineShuttingDownError("the engine is shutting down and accepts no new requests")
            if request_id in self._streams:
                raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
            self.lora_usage.enter(lora)  # InvalidRequestError while the adapter is being unloaded
            self._streams[request_id] = stream
            self._loops[request_id] = asyncio.get_running_loop()
            self._commands.append(_Add(request_id, stream.prompt_token_ids, stream.params, stream.tenant, priority,
                                       cache_salt, stream.stream_text, lora))
            self._idle.clear()
            self._cond.notify()

    def _release(self, stream: RequestStream, lora: str | None) -> None:
        with self._cond:
            self._streams.pop(stream.request_id, None)
            self._loops.pop(stream.request_id, None)
            self.lora_usage.leave(lora)
            if not stream.done:
                self._commands.append(_Abort([stream.request_id]))
                self._cond.notify()

    def _stop_completions(self, request_id: str, indices: list[int]) -> None:
        with self._cond:
            self._commands.append(_Stop(request_id, indices))
            self._cond.notify()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests; their streams end with a final snapshot, finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._cond:
            self._commands.append(_Abort(ids))
            self._cond.notify()

    async def call_between_steps(self, function: Callable[[], Any]) -> Any:
        """`function()` run on the engine thread between two steps, so it may change what steps read (a LoRA slot)."""
        self._ensure_started()
        with self._cond:
            if self._stop or not self._healthy:
                raise EngineShuttingDownError("the engine is stopped")
            self._commands.append(call := _Call(function))
            self._cond.notify()
        return await asyncio.wrap_future(call.future)

    async def load_lora(self, module: LoraModule) -> None:
        manager = self._lora_manager()
        adapter = await asyncio.to_thread(manager.read, module)
        await self.call_between_steps(lambda: manager.add(adapter))

    async def unload_lora(self, name: str) -> None:
        manager = self._lora_manager()
        await self.call_between_steps(lambda: manager.remove(name))

    def _lora_manager(self) -> LoraManager:
        if self.engine.lora is None:
            raise LoraConfigError("LoRA is not enabled on this engine (--enable-lora)")
        return self.engine.lora

    # -- the background thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stop or self.engine.has_unfinished_requests()
                               or self._stats.pending):
                        if any(p.dirty for p in self._periodic):
                            break  # publish the final state before sleeping
                        self._idle.set()
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stop = self._stop
                self._apply(commands)
                if stop:
                    self._abort_all()
                    return
                busy = self.engine.has_unfinished_requests()
                if busy:
                    self._deliver(self.engine.step())
                    if self.engine.last_step_num_tokens == 0:
                        self._back_off()
                self._answer_stats()
                self._run_periodic(changed=busy or bool(commands), idle=not busy)
        except Exception as exc:  # a crashed step must not leave any stream waiting forever
            logger.exception("engine step failed; failing in-flight requests")
            self._fail_all(exc)
        finally:  # the last asks get the final figures; later ones are built by the asker
            with self._cond:
                self._loop_done = True
            with contextlib.suppress(Exception):  # the engine may be broken
                self._answer_stats()
            self._stats.close()

    def _answer_stats(self) -> None:
        """Build the figures once for every ask waiting (nothing when none is)."""
        ticket = self._stats.pending
        if ticket:
            self._stats.answer(ticket, self.engine.stats())

    def _run_periodic(self, changed: bool, idle: bool) -> None:
        now = time.monotonic()
        for periodic in self._periodic:
            periodic.dirty |= changed
            if not periodic.dirty or (now < periodic.next_at and not idle):
                continue
            periodic.dirty = False
            periodic.next_at = now + periodic.interval_s
            try:
                periodic.callback()
            except Exception:  # bookkeeping must never stop the engine
                logger.exception("periodic engine task %r failed", periodic.callback)

    def _back_off(self) -> None:
        """Nothing could run (e.g. an eviction policy refuses blocks): wait for a command or a
        short while instead of spinning."""
        with self._cond:
            if not (self._commands or self._stop):
                self._cond.wait(timeout=_BACK_OFF_S)

    def _apply(self, commands: list[_Command]) -> None:
        for command in commands:
            if isinstance(command, _Call):
                try:
                    command.future.set_result(command.function())
                except Exception as exc:  # the caller's error, not the engine's
                    command.future.set_exception(exc)
                continue
            if isinstance(command, _Abort):
                self._deliver(self.engine.abort_request(command.request_ids))
                continue
            if isinstance(command, _Stop):
                self._deliver(self.engine.stop_completions(command.request_id, command.indices))
                continue
            try:
                self.engine.add_request(
                    command.request_id, command.prompt_token_ids, command.params,
                    tenant=command.tenant, priority=command.priority, cache_salt=command.cache_salt,
                    stream_text=command.stream_text, lora=command.lora,
                )
            except ValueError as exc:  # raced with a duplicate id, or other request validation
                self._send(command.request_id, exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their consumers' loops: one call per loop, fanned out there."""
        if not outputs:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutput]] = {}
        with self._cond:
            for output in outputs:
                loop = self._loops.get(output.request_id)
                if loop is not None:
                    by_loop.setdefault(loop, []).append(output)
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the consumer's loop is already closed
                loop.call_soon_threadsafe(self._fan_out, items)

    def _send(self, request_id: str, error: BaseException) -> None:
        with self._cond:
            stream, loop = self._streams.get(request_id), self._loops.get(request_id)
        if stream is not None and loop is not None:
            _fail_on(loop, stream, error)

    def _abort_all(self) -> None:
        self._deliver(self.engine.abort_request(list(self.engine.output_processor.request_ids())))
        with self._cond:
            pending = [c.request_id for c in self._commands if isinstance(c, _Add)]
            _drop_commands(self._commands)
        for request_id in pending:
            self._send(request_id, EngineShuttingDownError("the engine shut down before the request started"))
        self._idle.set()

    def _fail_all(self, exc: Exception) -> None:
        error = EngineError(f"the engine failed while serving this request: {type(exc).__name__}: {exc}")
        with self._cond:
            self._healthy = False
            self._accepting = False
            streams = [(self._loops[rid], stream) for rid, stream in self._streams.items()]
            _drop_commands(self._commands)
            waiters, self._death_waiters = self._death_waiters, []
        for loop, stream in streams:
            _fail_on(loop, stream, error)
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is already closed
                loop.call_soon_threadsafe(_resolve, future)
        with contextlib.suppress(Exception):  # free what can be freed; the engine may be broken
            self.engine.abort_request(list(self.engine.output_processor.request_ids()))
        self._idle.set()


def _fail_on(loop: asyncio.AbstractEventLoop, stream: RequestStream, error: BaseException) -> None:
    with contextlib.suppress(RuntimeError):  # the consumer's loop is already closed
        loop.call_soon_threadsafe(stream.fail, error)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _drop_commands(commands: list[_Command]) -> None:
    for command in commands:
        if isinstance(command, _Call):
            command.future.set_exception(EngineShuttingDownError("the engine stopped before the call ran"))
    commands.clear()
