"""What both generation endpoints share: the model check, prompt checks, and driving engine requests.

`ServingContext.generate` wraps `EngineClient.generate` with the server's bookkeeping: the request
is tracked for the drain, its metrics (TTFT, time per output token, token counts) are recorded
when it ends, and leaving early (client gone, error, drain) aborts it so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from sits.runtime.engine.client import EngineClient
from sits.runtime.engine.request import RequestOutput, SamplingParams
from sits.runtime.server.admission import AdmissionControl
from sits.runtime.server.errors import invalid_request, model_not_found, service_unavailable
from sits.runtime.server.input_limits import context_length_error, prompt_fills_context
from sits.runtime.server.lifecycle import Lifecycle
from sits.runtime.server.metrics import ServerMetrics
from sits.runtime.tasks import wait_first
from sits.runtime.tracing import NO_TRACER, RequestTracer

T = TypeVar("T")
logger = logging.getLogger("sits.server")

# Texts longer than this (characters) are tokenized in a worker thread, so a long prompt does not
# stall every other stream on the event loop (the tokenizer releases the GIL while it encodes).
TOKENIZE_INLINE_CHARS = 16_384


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


@dataclass
class ServingContext:
    """The engine and the server state the endpoint handlers work with."""

    engine: EngineClient
    model_name: str
    metrics: ServerMetrics
    lifecycle: Lifecycle
    tracer: RequestTracer = NO_TRACER  # spans of each ended request (--otlp-endpoint); a no-op by default
    # Called as (tenant, prompt_tokens, output_tokens) when an engine request ends (e.g. token quotas).
    usage_observer: Callable[[str, int, int], None] | None = None
    # Called as (tenant, prompt_tokens) when an engine request starts (its prompt counts at once).
    prompt_observer: Callable[[str, int], None] | None = None
    # The bounded queue in front of the engine (None: admit everything).
    admission: AdmissionControl | None = None
    _max_prompt_chars: int | None = field(default=None, init=False, repr=False)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def admit(self, request: Request, sequences: int, param: str = "n") -> None:
        """Reserve `sequences` engine sequences for this request, or raise 503 (full) / 400 (never fits)."""
        if self.admission is not None:
            self.admission.reserve(request.scope.setdefault("state", {}), sequences, param)

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit the context, whatever it says.

        No token covers more than the longest vocabulary entry's bytes, and a character is at
        least one byte, so a text longer than max_model_len x that many characters has more
        tokens than the context holds: it is refused without the work of tokenizing it.
        """
        if self._max_prompt_chars is None:
            tokenizer = self.tokenizer
            longest = max((len(tokenizer.token_to_bytes(i)) for i in range(tokenizer.vocab_size)), default=1)
            self._max_prompt_chars = self.max_model_len * max(longest, 1)
        return self._max_prompt_chars

    def check_text(self, text: str, param: str, name: str = "prompt") -> None:
        """400 for a text that is not valid Unicode (lone surrogates) or cannot fit the context."""
        if len(text) > self.max_prompt_chars:
            raise context_length_error(self.max_model_len, f"your {name} has {len(text)} characters, more than "
                                       "that many tokens can hold", f"shorten the {name}", param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise invalid_request(f"The {name} is not valid Unicode: {error.reason} at position {error.start}.",
                                  param=param, code="invalid_unicode") from None

    async def encode(self, text: str, *, add_special_tokens: bool, param: str, name: str = "prompt") -> list[int]:
        """Token ids of a checked text; long texts are tokenized off the event loop."""
        self.check_text(text, param, name)
        if len(text) <= TOKENIZE_INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def context_limit(self, tenant: str) -> int:
        """The longest sequence (prompt + output tokens) this tenant may run: the model's context,
        or less when the tenant's share of the KV cache holds fewer tokens."""
        return min(self.max_model_len, self.engine.max_tokens_for(tenant))

    @property
    def lora_modules(self) -> dict[str, Any]:
        """The LoRA adapters served as models of their own (name -> `LoraModule`), as the engine has them."""
        return self.engine.lora_modules

    @property
    def served_models(self) -> list[str]:
        """Every model id this server answers to: the base model's, then each adapter's."""
        return [self.model_name, *self.lora_modules]

    def check_model(self, model: str | None, allowed: Collection[str] | None = None) -> str | None:
        """The LoRA adapter `model` names, None for the base model (also when no model is sent);
        404 for a model this server does not serve, and the same 404 for one outside `allowed`
        (the tenant's allow-list, None for every served model; no model sent means the base
        model), so a tenant cannot tell a model kept from it from one that does not exist."""
        asked = self.model_name if model is None else model
        if allowed is not None and asked not in allowed:
            raise model_not_found(asked)
        if model is None or model == self.model_name:
            return None
        if model in self.lora_modules:
            return model
        raise model_not_found(model)

    def check_ready(self) -> None:
        if self.lifecycle.draining:
            raise service_unavailable("The server is shutting down; retry on another replica.")
        if not self.engine.is_healthy:
            raise service_unavailable("The engine is unhealthy and cannot serve requests.")
        if not self.engine.is_accepting:
            raise service_unavailable("The engine is stopping and accepts no new requests.")

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> list[int]:
        """Token ids given by the client must exist in the vocabulary."""
        if len(token_ids) >= self.max_model_len:  # before the loop over what may be millions of ids
            raise prompt_fills_context(self.max_model_len, len(token_ids), "prompt", param)
        vocab_size = self.tokenizer.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid_request(f"token id {bad} is out of range (vocabulary size {vocab_size})", param=param)
        if not token_ids:
            raise invalid_request("the prompt is empty", param=param)
        return list(token_ids)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       tenant: str, arrival: float, priority: int = 0,
                       cache_salt: str | None = None, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one request; closing this early aborts the request.

        arrival is the request's time.perf_counter() when it reached the server (for TTFT);
        priority is what the tenant resolver left on request.state (0 by default); cache_salt
        keeps the prompt's cached KV blocks private to the tenant (`request_cache_salt`); lora is
        the adapter `check_model` found (None: the base model).
        """
        self.lifecycle.track(request_id)
        self._observe(self.prompt_observer, tenant, len(prompt_token_ids))
        stream = self.engine.generate(prompt_token_ids, params, request_id, tenant=tenant, priority=priority,
                                      cache_salt=cache_salt, lora=lora)
        first_token_at: float | None = None
        last: RequestOutput | None = None
        try:
            async for output in stream:
                if first_token_at is None and any(o.token_ids for o in output.outputs):
                    first_token_at = time.perf_counter()
                last = output
                yield output
        finally:
            self.lifecycle.untrack(request_id)
            if last is None or not last.finished:
                # Cancelling or closing the engine's stream aborts the request and frees its blocks.
                with contextlib.suppress(Exception):
                    await stream.aclose()
            self._record(prompt_token_ids, last, tenant, arrival, first_token_at)
            self.tracer.record_request(request_id, tenant, params, last, model=lora or self.model_name,
                                       track=self.metrics.track)

    def _record(self, prompt_token_ids: list[int], last: RequestOutput | None, tenant: str, arrival: float,
                first_token_at: float | None) -> None:
        lengths = [len(o.token_ids) for o in last.outputs] if last is not None else []
        longest = max(lengths, default=0)
        tpot = None
        if first_token_at is not None and longest > 1:
            tpot = (time.perf_counter() - first_token_at) / (longest - 1)
        self.metrics.observe_generation(
            tenant, prompt_tokens=len(prompt_token_ids), output_tokens=sum(lengths),
            ttft_s=None if first_token_at is None else first_token_at - arrival, tpot_s=tpot)
        self._observe(self.usage_observer, tenant, len(prompt_token_ids), sum(lengths))

    @staticmethod
    def _observe(observer: Callable[..., None] | None, *args: Any) -> None:
        if observer is None:
            return
        try:
            observer(*args)
        except Exception:  # accounting must never break a response
            logger.exception("usage observer failed")


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (index, item) in arrival order; closing stops them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream) as items:  # type: ignore[type-var]
                async for item in items:
                    await queue.put((index, item))
        except Exception as error:  # handed to the consumer, which re-raises it
            await queue.put((index, error))
        await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_unless_disconnected(stream: AsyncIterator[tuple[int, T]], request: Request) -> dict[int, T]:
    """The last item per index of a merged stream; raises ClientGone (stopping it) if the client leaves."""

    async def consume() -> dict[int, T]:
        last: dict[int, T] = {}
        async with contextlib.aclosing(stream) as items:  # type: ignore[type-var]
            async for index, item in items:
                last[index] = item
        return last

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(until_disconnected(request))
    try:
        await wait_first(consumer, watcher)
    finally:
        if consumer.cancelled():
            request.state.client_gone = True
    if consumer.cancelled():
        raise ClientGone
    return consumer.result()
