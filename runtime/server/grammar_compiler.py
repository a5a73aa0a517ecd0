"""Compiling a request's output grammar without letting one request stall the server.

xgrammar's compile time grows about with the cube of a JSON schema's nesting (300 levels: ~3 s;
900: over a minute), and a thread running it cannot be stopped. So before a structured request
takes any admission slot (`GenerationGate`, `AdmissionControl`), its constraint goes through:

1. **Limits** (`check_spec_limits`): the constraint's text (schema JSON, regex, grammar, choices)
   is at most `max_bytes` UTF-8 bytes and nests at most `max_depth` levels (JSON objects and arrays
   of a schema; parentheses, brackets and braces of a regex or grammar). Beyond: a 400 naming the
   param the client sent (`response_format`, `tools`, `structured_outputs`, `guided_*`).
2. **The cache**: a constraint compiled lately is served from the engine's `GrammarCache` at once.
3. **A per-tenant bound**: a tenant runs at most `per_tenant` compiles at once, and at most
   `queue_per_tenant` more wait for their turn (holding no admission slot, only their connection);
   one more is a 429 (Retry-After). A tenant cannot fill the workers that other tenants need.
4. **A worker process with a timeout** (`grammar_worker.py`, `workers` of them, started on first
   use): the compile runs there first. Past `compile_timeout_s` the worker is killed and the
   request gets a 400 naming its param; when the client leaves meanwhile, the worker is killed too.
5. **The compile that is kept** runs on this class's own threads (never the default executor
   where prompts are tokenized), now known to finish within about the timeout, and lands in the
   engine's cache, where the engine finds it.

Why compile twice rather than ship the worker's result: `CompiledGrammar.serialize_json` exists,
but measured with SmolLM2's 49k vocabulary (xgrammar 0.2.9) it costs more than compiling again:
10 nested arrays compile in 12 ms, serialize in 17 ms and deserialize in 11 ms (160 KB); at 100
levels 0.23 s against 0.94 + 0.44 s (8.6 MB); at 200 levels 1.2 s against 8.4 + 2.5 s (35 MB).
The worker is therefore the bounded, killable check, and the cache is filled here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sits.runtime.engine.request import StructuredOutputSpec
from sits.runtime.engine.structured_output import GrammarCache, StructuredOutputError
from sits.runtime.metrics_collector import SERVER_LABELS
from sits.runtime.server.collector import ScrapeCollector
from sits.runtime.server.errors import OpenAIError
from sits.runtime.server.limits_config import GrammarLimits
from sits.runtime.tasks import wait_first

logger = logging.getLogger("sits.server")
T = TypeVar("T")

WORKER_MODULE = "sits.runtime.server.grammar_worker"
WORKER_BOOT_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh process; not the compile's time
_ANSWER_LIMIT = 1 << 20  # bytes of one answer line from a worker (they are tiny)


def check_spec_limits(spec: StructuredOutputSpec, limits: GrammarLimits) -> None:
    """Raise StructuredOutputError (a 400 naming `spec.param`) for a constraint over the limits."""
    text = spec.text or ""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise StructuredOutputError(f"{spec.source} is {size} bytes; at most {limits.max_bytes} are accepted",
                                    spec.param)
    depth = nesting_depth(text, spec.kind)
    if depth > limits.max_depth:
        raise StructuredOutputError(f"{spec.source} nests {depth} levels deep; at most {limits.max_depth} "
                                    "are accepted", spec.param)


_OPEN, _CLOSE = frozenset("{[("), frozenset("}])")


def nesting_depth(text: str, kind: str) -> int:
    """The deepest nesting of brackets in `text` (a spec's kind: json_schema, regex, grammar, choice).

    JSON: objects and arrays, outside double-quoted strings. Grammar (EBNF) and choice: (), [] and {}
    outside double-quoted literals. Regex: (), [] and {} wherever they are (a quote is an ordinary
    character there), except backslash-escaped ones. Linear, no recursion (the text may nest far
    deeper than Python's stack).
    """
    quotes = kind != "regex"
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_string:
            in_string = char != '"'
        elif char == '"' and quotes:
            in_string = True
        elif char in _OPEN and (kind != "json_schema" or char != "("):
            depth += 1
            deepest = max(deepest, depth)
        elif char in _CLOSE and (kind != "json_schema" or char != ")"):
            depth = max(depth - 1, 0)
    return deepest


class ClientLeft(Exception):
    """The client disconnected while its grammar was compiling (the compile was stopped)."""


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, tokenizer_info_json: str) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", WORKER_MODULE, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=_ANSWER_LIMIT)
        worker = cls(process)
        try:
            answer = await asyncio.wait_for(worker._send(tokenizer_info_json), WORKER_BOOT_TIMEOUT_S)
        except BaseException:
            await worker.kill()
            raise
        if not answer.get("ready"):
            await worker.kill()
            raise RuntimeError("the grammar worker did not start")
        return worker

    async def _send(self, line: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()
        answer = await self.process.stdout.readline()
        if not answer:
            raise EOFError("the grammar worker exited")
        return json.loads(answer)

    async def compile(self, spec: StructuredOutputSpec) -> str | None:
        """None when `spec` compiles; else xgrammar's reason (a message naming the field)."""
        answer = await self._send(json.dumps({"kind": spec.kind, "text": spec.text, "source": spec.source}))
        return answer.get("error")

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


class GrammarCompiler:
    """The server's grammar compiles: limits, per-tenant bound, killable workers, then the cache.

    Args:
        cache: the engine's grammar cache (compiled grammars the engine reads).
        limits: the bounds (`GrammarLimits`).
    Use `await compile(spec, tenant, disconnected)` per request and `await close()` at shutdown.
    """

    def __init__(self, cache: GrammarCache, limits: GrammarLimits | None = None) -> None:
        self.cache = cache
        self.limits = limits or GrammarLimits()
        self.limits.validate()
        self._executor = ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="sits-grammar")
        self._slots: asyncio.Semaphore | None = None  # made on the serving loop, on first use
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._in_flight: dict[str, int] = {}  # tenant -> compiles waiting or running
        self._tenant_turns: dict[str, asyncio.Semaphore] = {}  # tenant -> its `per_tenant` running compiles
        self._tokenizer_info: str | None = None
        self.killed = 0  # workers killed (timeout or client gone), cumulative
        self.timed_out = 0  # compiles refused for the timeout, cumulative
        self.refused = 0  # compiles refused with 429 (the tenant's bound), cumulative

    async def prepare(self) -> None:
        """Build xgrammar's view of the vocabulary now (at start-up, before the server is ready).

        Building it holds the GIL for a while (about 0.2 s idle, seconds on a loaded machine): done
        on the first structured request it would stall every other request once. Worker processes
        still start on first use (each imports xgrammar: seconds, not counted in the timeout).
        """
        if self._tokenizer_info is None:
            self._tokenizer_info = await self._on_thread(self.cache.tokenizer_info_json)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    async def compile(self, spec: StructuredOutputSpec | None, tenant: str,
                      disconnected: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Make `spec` ready in the engine's cache, or raise.

        Args:
            spec: the request's constraint (None: nothing to do).
            tenant: whose compile it is (the per-tenant bound).
            disconnected: makes an awaitable that completes when the client leaves (e.g.
                `lambda: serving.until_disconnected(request)`); the compile is then stopped (its
                worker killed) and ClientLeft raised.
        Raises:
            StructuredOutputError: over a limit, refused by xgrammar, or past the timeout (400).
            OpenAIError: 429 when `per_tenant` + `queue_per_tenant` compiles of the tenant are in flight.
            ClientLeft: the client disconnected first.
        """
        if spec is None:
            return
        if spec.kind == "json_object":  # one fixed, small grammar: no client text to bound
            if not self.cache.contains(spec):
                await self._on_thread(self.cache.compile, spec)
            return
        check_spec_limits(spec, self.limits)
        if self.cache.contains(spec):
            return
        if self.in_flight(tenant) >= self.limits.per_tenant + self.limits.queue_per_tenant:
            self.refused += 1
            raise OpenAIError(429, f"Too many output grammars compiling for this tenant (at most "
                                   f"{self.limits.per_tenant + self.limits.queue_per_tenant} at once, "
                                   "running or waiting); retry shortly.",
                              param=spec.param, code="too_many_grammar_compiles", headers={"Retry-After": "1"})
        self._in_flight[tenant] = self.in_flight(tenant) + 1
        turns = self._tenant_turns.setdefault(tenant, asyncio.Semaphore(self.limits.per_tenant))
        try:
            await self._unless_disconnected(self._in_turn(turns, spec), disconnected)
        finally:
            self._in_flight[tenant] -= 1
            if not self._in_flight[tenant]:
                del self._in_flight[tenant]
                del self._tenant_turns[tenant]

    async def _in_turn(self, turns: asyncio.Semaphore, spec: StructuredOutputSpec) -> None:
        async with turns:
            if not self.cache.contains(spec):  # the same schema may have compiled while this one waited
                await self._checked_then_cached(spec)

    async def _unless_disconnected(self, work: Awaitable[T], disconnected: Callable[[], Awaitable[Any]] | None) -> T:
        task = asyncio.ensure_future(work)
        if disconnected is None:
            return await task
        await wait_first(task, asyncio.ensure_future(disconnected()))
        if task.cancelled():
            raise ClientLeft
        return task.result()

    async def _checked_then_cached(self, spec: StructuredOutputSpec) -> None:
        await self._check_in_worker(spec)
        await self._on_thread(self.cache.compile, spec)  # shown to finish in about the timeout

    async def _check_in_worker(self, spec: StructuredOutputSpec) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.workers)
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._start_worker()
            self._busy.add(worker)
            reusable = False
            try:
                reason = await asyncio.wait_for(worker.compile(spec), self.limits.compile_timeout_s)
                reusable = True
            except TimeoutError:
                self.timed_out += 1
                raise StructuredOutputError(
                    f"{spec.source} takes longer than {self.limits.compile_timeout_s:g} s to compile; "
                    "simplify it (fewer nesting levels or alternatives)", spec.param) from None
            except EOFError:  # the grammar engine crashed on it
                raise StructuredOutputError(f"{spec.source} cannot be enforced", spec.param) from None
            finally:
                self._busy.discard(worker)
                if reusable:
                    self._idle.append(worker)
                else:
                    self.killed += 1
                    await asyncio.shield(worker.kill())
            if reason is not None:
                raise StructuredOutputError(reason, spec.param)

    async def _start_worker(self) -> _Worker:
        await self.prepare()
        assert self._tokenizer_info is not None
        return await _Worker.start(self._tokenizer_info)

    async def _on_thread(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def close(self) -> None:
        """Kill the workers and stop the grammar threads (at the app's shutdown)."""
        workers, self._idle = [*self._idle, *self._busy], []
        self._busy.clear()
        await asyncio.gather(*(worker.kill() for worker in workers), return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)


class GrammarCompileCollector(ScrapeCollector):
    """Prometheus view of a GrammarCompiler, read at scrape time (`sits_grammar_*`)."""

    def __init__(self, compiler: GrammarCompiler, model: str, track: str) -> None:
        super().__init__(model, track)
        self._compiler = compiler

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        compiler, labels = self._compiler, SERVER_LABELS
        in_flight = GaugeMetricFamily("sits_grammar_compiles_in_flight", "Output grammars compiling or waiting for "
                                      "their turn (requests that hold no admission slot yet).", labels=labels)
        in_flight.add_metric(self._labels, float(sum(compiler._in_flight.values())))
        yield in_flight
        for name, doc, value in (
                ("sits_grammar_compile_timeouts", "Grammar compiles stopped at --grammar-compile-timeout (400).",
                 compiler.timed_out),
                ("sits_grammar_compile_workers_killed", "Compile worker processes killed (timeout or client gone).",
                 compiler.killed),
                ("sits_grammar_compiles_refused", "Grammar compiles refused with 429 (a tenant's bound).",
                 compiler.refused)):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(self._labels, float(value))
            yield counter
