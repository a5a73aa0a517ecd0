"""The engine core process: `LLMEngine`'s step loop on its own interpreter, fed over a pipe.

`sits serve` spawns this (`MultiprocessEngineClient`, `core_client.py`) so that HTTP, pydantic,
tokenization and SSE for hundreds of streams never compete with the step loop for one GIL, as vLLM
v1 moved its EngineCore out of the API server.

Transport: one duplex `multiprocessing` pipe (an AF_UNIX socket pair), messages pickled with
protocol 5 (`core_wire.py`). Why not ZMQ + msgspec as vLLM uses: neither is installed here or on
the GPU machines, and a single reader and writer per side need none of ZMQ's patterns; pickle
carries the engine's own dataclasses (SamplingParams, EngineStats, the TenantTable) without a
second schema to keep in step, and protocol 5 frames large buffers without extra copies. The cost
that matters, pickling per-step outputs, is kept small by sending token deltas as plain tuples
(`OutputEncoder`); the text is decoded in the server (`request_stream.py`). Both
directions are batched: the server sends what one event-loop turn gathered, the engine one
`CoreBatch` per step.

Threads here: the loop thread owns the engine (commands, a step, one batch pickled and written; the
main thread only builds the engine and waits). The loop writes each batch itself with a non-blocking
send (`pipe_writer.PipeWriter`): a sender thread takes over only while the pipe is full (a server slow
to read), so a step never waits on the server and, in the common case, no other thread wakes per step;
a receiver thread reads the pipe (so a command never waits for a step to end to be read), compiles
a request's grammar before the request reaches the loop (xgrammar's compile can take tens of ms;
the cache is thread-safe), and reads LoRA adapters from disk off the loop. The engine's stats go
out only in answer to a `StatsRequest`, built once between two steps (`_answer_stats`), never per
step (`sits.runtime.engine.stats.StatsAnswers` says why).

Parent death: the process asks the kernel for SIGKILL when its parent dies (`prctl
PR_SET_PDEATHSIG`), and the pipe's EOF ends the loop as well; tensor-parallel workers, children of
this process, watch it the same way (`sits.runtime.parallel.worker`). SIGINT and SIGTERM are
ignored: a Ctrl-C in a terminal, or a supervisor signalling the process group, reaches the engine
too, and the server drains first and then tells the engine to stop (or SIGKILLs it).

Profiling: with `SITS_ENGINE_PROFILE=DIR` in the server's environment, the loop and receiver threads
run under their own `cProfile` (timed in that thread's CPU time) and write
`DIR/engine-<pid>-<thread>.prof` when the loop ends (an orderly stop: SIGTERM to the server, or its
exit); read them with `python -m pstats`. Off by default: it slows steps. With `SITS_ENGINE_STEP_TRACE=DIR`
each step's composition and return time go to `DIR/engine-<pid>-steps.jsonl` (`step_trace.py`).
"""

from __future__ import annotations

import contextlib
import cProfile
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sits.runtime.config import ConfigError, EngineConfig
from sits.runtime.engine import core_wire as wire
from sits.runtime.engine.client_base import EngineFacts
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.errors import EngineError, EngineShuttingDownError
from sits.runtime.engine.pipe_writer import PipeWriter
from sits.runtime.engine.step_trace import StepTrace
from sits.runtime.gc_heap import freeze_startup_heap
from sits.runtime.lora.manager import LoraAdapter, LoraManager

logger = logging.getLogger("sits.engine_core")

_BACK_OFF_S = 0.05  # wait after a step that could schedule nothing
_PR_SET_PDEATHSIG = 1
STOP_FLUSH_S = 10.0  # how long the last batches may take to be written once the loop ended
EVICTION_INDEX_INTERVAL_S = 1.0  # how often the eviction index and tenancy figures go to the server
PROFILE_ENV = "SITS_ENGINE_PROFILE"  # a directory: the threads' cProfile stats go there (module docstring)


def die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when the parent dies (Linux), and exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the pipe's EOF still ends the loop
            logger.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the pipe to notice the server's exit")
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def run_engine_core(conn: Connection, config: EngineConfig, tenancy_spec: Any, parent_pid: int,
                    log_level: str) -> None:
    """The child's entry point: build the engine, say Ready (or StartFailed), then loop until told to stop."""
    die_with_parent(parent_pid)
    for name in (signal.SIGINT, signal.SIGTERM):  # sent to the whole group: the server decides how we stop
        signal.signal(name, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    tenancy = None
    trace = None
    try:
        hooks: dict = {}
        if tenancy_spec is not None:
            from sits.runtime.tenancy.engine_side import EngineTenancy

            tenancy = EngineTenancy.from_spec(tenancy_spec)
            hooks = tenancy.engine_hooks()
        trace = StepTrace.from_env()
        if trace is not None:
            hooks["step_observer"] = trace.observe
        engine = LLMEngine.from_config(config, progress=True, **hooks)
    except Exception as error:
        from sits.runtime.models.errors import ModelLoadError

        user_error = isinstance(error, ConfigError | ModelLoadError | FileNotFoundError | EngineError)
        if not user_error:
            logger.exception("the engine failed to start")
        conn.send_bytes(wire.encode(wire.StartFailed(str(error) if user_error else f"{type(error).__name__}: "
                                                     f"{error}", user_error)))
        return
    core = EngineCore(engine, conn, tenancy, trace)
    freeze_startup_heap("engine process")  # full collections would stall steps (gc_heap.py)
    conn.send_bytes(wire.encode(core.ready()))
    # The loop runs on its own thread, as AsyncEngine's does in-process: torch's intra-op (OpenMP)
    # pool then behaves as it does there (on a busy CPU the main thread's team of spinning OpenMP
    # threads made steps up to 10x slower).
    crashed = threading.Event()
    loop = threading.Thread(target=_run_core, args=(core, crashed), name="sits-engine-loop")
    loop.start()
    loop.join()
    if trace is not None:
        trace.close()
    engine.shutdown()
    if crashed.is_set():  # the server sees the pipe close and fails what was in flight
        os._exit(1)


def _run_core(core: EngineCore, crashed: threading.Event) -> None:
    try:
        core.run()
    except Exception:
        logger.exception("engine step failed; the engine process exits")
        crashed.set()


class ThreadProfiles:
    """`SITS_ENGINE_PROFILE=DIR`: one cProfile per thread (a profile follows only the thread that enabled
    it), written to DIR/engine-<pid>-<name>.prof by `dump`. Without the variable `wrap` returns its target."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._profiles: dict[str, cProfile.Profile] = {}

    @classmethod
    def from_env(cls) -> ThreadProfiles:
        return cls(Path(os.environ[PROFILE_ENV]) if os.environ.get(PROFILE_ENV) else None)

    def wrap(self, name: str, target: Callable[[], None]) -> Callable[[], None]:
        """`target`, run under a profile of its own when profiling is on."""
        if self.directory is None:
            return target

        def profiled() -> None:
            # CPU time of this thread: on a shared machine wall time mostly measures the other processes
            profile = self._profiles[name] = cProfile.Profile(time.thread_time)
            profile.enable()
            try:
                target()
            finally:
                profile.disable()

        return profiled

    def dump(self) -> None:
        """Write every profile, also of threads still running (a snapshot: the receiver waits on the pipe)."""
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for name, profile in list(self._profiles.items()):
                path = self.directory / f"engine-{os.getpid()}-{name}.prof"
                profile.dump_stats(path)
                logger.info("engine %s thread's profile written to %s", name, path)
        except OSError as error:
            logger.warning("could not write the engine's profiles to %s: %s", self.directory, error)


@dataclass
class _AdapterRead:
    """An adapter read off the loop, to be written into a slot between steps."""

    call_id: int
    adapter: LoraAdapter


class EngineCore:
    """The loop (see the module docstring). Args: the engine, the pipe, the engine-side tenancy (or None), the
    step trace (`SITS_ENGINE_STEP_TRACE`, or None; its observer is already the engine's step_observer)."""

    def __init__(self, engine: LLMEngine, conn: Connection, tenancy: Any = None, trace: StepTrace | None = None
                 ) -> None:
        self.engine = engine
        self.conn = conn
        self.tenancy = tenancy
        self._trace = trace
        if trace is not None:
            trace.attach(engine)
        engine.output_processor.detokenize = False  # the server decodes the text and applies stop strings
        self._cond = threading.Condition()
        self._inbox: list = []  # guarded by _cond: commands from the server and from helper threads
        self._parent_gone = False
        self._encoder = wire.OutputEncoder()
        self._writer: PipeWriter | None = None  # while run() runs
        self._stop_deadline: float | None = None  # monotonic time by which a Shutdown aborts what runs
        self._dirty = False  # engine state changed since the tenancy figures last went out
        self._next_publish = 0.0

    def ready(self) -> wire.Ready:
        engine = self.engine
        return wire.Ready(EngineFacts.of(engine), self._lora_modules(), self._room(), engine.stats())

    # -- receiving ---------------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                commands = wire.decode(self.conn.recv_bytes())
            except (EOFError, OSError):
                with self._cond:
                    self._parent_gone = True
                    self._cond.notify()
                return
            for command in commands:
                if isinstance(command, wire.AddRequest) and command.params.structured_output is not None:
                    with contextlib.suppress(Exception):  # compiled off the loop; add_request reports a refusal
                        self.engine.structured_outputs.cache.compile(command.params.structured_output)
                elif isinstance(command, wire.LoadLora):
                    threading.Thread(target=self._read_adapter, args=(command,), daemon=True).start()
                    continue
            with self._cond:
                self._inbox.extend(c for c in commands if not isinstance(c, wire.LoadLora))
                self._cond.notify()

    def _read_adapter(self, command: wire.LoadLora) -> None:
        """Read and check an adapter off the loop; the loop writes it into a slot between steps."""
        try:
            if self.engine.lora is None:
                raise EngineError("LoRA is not enabled on this engine (--enable-lora)")
            item: Any = _AdapterRead(command.call_id, self.engine.lora.read(command.module))
        except Exception as error:
            item = wire.CallResult(command.call_id, wire.wire_error(error), self._lora_modules())
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """The loop until told to stop or the server is gone; what it sent is flushed before it returns."""
        profiles = ThreadProfiles.from_env()
        threading.Thread(target=profiles.wrap("receiver", self._receive), name="sits-engine-core-receiver",
                         daemon=True).start()
        self._writer = PipeWriter(self.conn)
        try:
            profiles.wrap("loop", self._loop)()
        finally:
            self._writer.close(STOP_FLUSH_S)
            profiles.dump()

    def _send(self, batch: wire.CoreBatch) -> None:
        assert self._writer is not None
        self._writer.write(wire.encode(batch))

    def _loop(self) -> None:
        while True:
            commands, gone = self._wait_for_work()
            if gone:
                logger.warning("the server went away; the engine process exits")
                return
            batch = wire.CoreBatch()
            self._apply(commands, batch)
            commands = self._answer_stats(commands)
            busy = self.engine.has_unfinished_requests()
            if busy:
                self._deliver(self.engine.step(), batch)
                if self._trace is not None:
                    self._trace.stamp()
                if self.engine.last_step_num_tokens == 0:
                    self._back_off()
            self._dirty |= busy or bool(commands)
            deadline = self._stop_deadline
            if deadline is not None and (not self.engine.has_unfinished_requests() or time.monotonic() >= deadline):
                self._deliver(self.engine.abort_request(list(self.engine.output_processor.request_ids())), batch)
                batch.stopped = True
            self._publish_tenancy(batch, idle=not self.engine.has_unfinished_requests())
            if commands or busy or batch.stopped or batch.tenancy_usage is not None:
                self._send(batch)
            if batch.stopped:
                return

    def _answer_stats(self, commands: list) -> list:
        """Answer the StatsRequests among the commands just applied now, before the next step, with one
        build (asked during a step, the figures include what that step did); returns the other commands."""
        tickets = [command.ticket for command in commands if isinstance(command, wire.StatsRequest)]
        if not tickets:
            return commands
        self._send(wire.CoreBatch(stats=self.engine.stats(), stats_ticket=max(tickets)))
        return [command for command in commands if not isinstance(command, wire.StatsRequest)]

    def _wait_for_work(self) -> tuple[list, bool]:
        with self._cond:
            while not (self._inbox or self._parent_gone or self.engine.has_unfinished_requests()
                       or self._stop_deadline is not None):
                if self._dirty and self.tenancy is not None:
                    break  # publish the idle state before sleeping
                self._cond.wait()
            commands, self._inbox = self._inbox, []
            return commands, self._parent_gone

    def _back_off(self) -> None:
        """Nothing could run (e.g. an eviction policy refuses blocks): wait for a command or a
        short while instead of spinning."""
        with self._cond:
            if not (self._inbox or self._parent_gone):
                self._cond.wait(timeout=_BACK_OFF_S)

    def _apply(self, commands: list, batch: wire.CoreBatch) -> None:
        for command in commands:
            if isinstance(command, wire.AddRequest):
                self._add(command, batch)
            elif isinstance(command, wire.AbortRequests):
                self._deliver(self.engine.abort_request(command.request_ids), batch)
            elif isinstance(command, wire.StopCompletions):
                self._deliver(self.engine.stop_completions(command.request_id, command.indices), batch)
            elif isinstance(command, wire.CallResult):  # an adapter that could not be read
                batch.results.append(command)
            elif isinstance(command, _AdapterRead):
                batch.results.append(self._call(command.call_id, partial(LoraManager.add, adapter=command.adapter)))
            elif isinstance(command, wire.UnloadLora):
                batch.results.append(self._call(command.call_id, partial(LoraManager.remove, name=command.name)))
            elif isinstance(command, wire.NewTenantTable):
                if self.tenancy is not None:
                    self.tenancy.apply_table(command.table)
                    batch.room = self._room()
            elif isinstance(command, wire.Shutdown):
                self._stop_deadline = time.monotonic() + max(command.drain_timeout_s, 0.0)

    def _add(self, command: wire.AddRequest, batch: wire.CoreBatch) -> None:
        if self._stop_deadline is not None:
            error = EngineShuttingDownError("the engine is shutting down and accepts no new requests")
            batch.errors.append((command.request_id, wire.wire_error(error)))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    tenant=command.tenant, priority=command.priority, cache_salt=command.cache_salt,
                                    stream_text=command.stream_text, lora=command.lora)
        except ValueError as error:  # the client's fault: a 400 at the edge
            batch.errors.append((command.request_id, wire.wire_error(error)))

    def _call(self, call_id: int, function: Callable[[LoraManager], object]) -> wire.CallResult:
        """`function(the LoRA manager)` between steps, answered as a CallResult."""
        try:
            if self.engine.lora is None:
                raise EngineError("LoRA is not enabled on this engine (--enable-lora)")
            function(self.engine.lora)
            error = None
        except Exception as exc:  # the caller's error (name taken, no free slot), not the engine's
            error = wire.wire_error(exc)
        return wire.CallResult(call_id, error, self._lora_modules())

    def _deliver(self, outputs: list, batch: wire.CoreBatch) -> None:
        batch.outputs.extend(self._encoder.encode(output) for output in outputs)

    def _publish_tenancy(self, batch: wire.CoreBatch, idle: bool) -> None:
        """Every EVICTION_INDEX_INTERVAL_S while the engine changes, and once when it goes idle:
        the eviction index (for the state store) and the figures /metrics exports."""
        if self.tenancy is None or not self._dirty:
            return
        now = time.monotonic()
        if now < self._next_publish and not idle:
            return
        self._dirty = False
        self._next_publish = now + EVICTION_INDEX_INTERVAL_S
        try:
            batch.eviction_index = self.tenancy.eviction_index()
            batch.kv_state = self.tenancy.kv_state()
            batch.tenancy_usage = self.tenancy.usage()
            batch.room = self._room()  # a new table's shares apply lazily: send what they are now
        except Exception:  # bookkeeping must never stop the engine
            logger.exception("reading the tenancy figures failed")

    # -- facts -------------------------------------------------------------------------------
    def _lora_modules(self) -> dict:
        return dict(self.engine.lora.modules) if self.engine.lora is not None else {}

    def _room(self) -> wire.TenantRoom:
        kv = self.engine.kv_cache
        names = self.tenancy.table.names if self.tenancy is not None else ()
        return wire.TenantRoom({name: kv.max_tokens_for(name) for name in ("default", *names)},
                               kv.max_tokens_for("\x00a tenant no table names"))
