"""What crosses the pipe between the API server and the engine process, and how outputs shrink.

Both directions send one pickled list per batch (`encode` / `decode`, pickle protocol 5): the server
sends the commands gathered in one event-loop turn, the engine sends one `CoreBatch` per step.

Outputs travel as deltas. An in-process `RequestOutput` is a snapshot: every step it carries the
prompt's token ids, each completion's whole text, token ids and logprobs so far, and the prompt
logprobs. Pickled per step for hundreds of sequences that would grow with every token, so
`OutputEncoder` (engine side) sends only what the step added (`WireCompletion`), the whole field
only when it did not simply grow (a stop string cut the text), the prompt logprobs once and the
prompt never; `OutputDecoder` (server side, one per request) rebuilds the same snapshots, so the
server code sees exactly what the in-process engine gives it.

Errors cross as `WireError` (kind, message, param): exceptions with their own constructors do not
all survive pickling, and the server only needs the class that picks the HTTP status.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from sits.runtime.engine.client import ModelInfo
from sits.runtime.engine.errors import (
    DuplicateRequestError,
    EngineError,
    EngineShuttingDownError,
    InvalidRequestError,
    PromptTooLongError,
)
from sits.runtime.engine.request import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    SamplingParamsError,
    TokenLogprob,
)
from sits.runtime.engine.stats import EngineStats
from sits.runtime.lora.config import LoraConfigError, LoraFileError, LoraModule

PICKLE_PROTOCOL = 5


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=PICKLE_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)


# -- server -> engine ----------------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    priority: int
    cache_salt: str | None
    stream_text: bool
    lora: str | None


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class LoadLora:
    call_id: int
    module: LoraModule


@dataclass
class UnloadLora:
    call_id: int
    name: str


@dataclass
class NewTenantTable:
    table: Any  # sits.runtime.tenancy.tenants.TenantTable


@dataclass
class StatsRequest:
    """Ask for the engine's figures: answered between steps by a CoreBatch whose stats_ticket is
    this ticket or a later one (`sits.runtime.engine.stats.StatsAnswers`)."""

    ticket: int


@dataclass
class Shutdown:
    """Finish what runs for up to drain_timeout_s, abort the rest, answer `Stopped` and exit."""

    drain_timeout_s: float = 0.0


# -- engine -> server ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TenantRoom:
    """The longest sequence each tenant can hold in the KV cache, in tokens (`max_tokens_for`)."""

    by_tenant: dict[str, int]
    other: int  # a tenant the table does not name

    def max_tokens_for(self, tenant: str) -> int:
        return self.by_tenant.get(tenant, self.other)


@dataclass
class Ready:
    """The engine loaded: what the server needs to check requests and describe the model."""

    tokenizer: Any  # sits.runtime.models.tokenizer.Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    model_info: ModelInfo
    lora_modules: dict[str, LoraModule]
    room: TenantRoom
    stats: EngineStats


@dataclass
class StartFailed:
    """The engine could not be built: a one-line reason, and whether it is the user's (exit 2)."""

    message: str
    user_error: bool


@dataclass(frozen=True)
class WireError:
    kind: str  # one of _ERROR_KINDS' keys
    message: str
    param: str | None = None


@dataclass(frozen=True)
class WireCompletion:
    """One completion's change in one step (see the module docstring); `full_*` set only when the
    field did not grow by its delta."""

    index: int
    text_delta: str
    token_ids_delta: list[int]
    logprobs_delta: list[TokenLogprob] | None
    cumulative_logprob: float
    finish_reason: Any  # FinishReason | None
    stop_reason: str | int | None
    full_text: str | None = None
    full_token_ids: list[int] | None = None
    full_logprobs: list[TokenLogprob] | None = None
    has_logprobs: bool = False


@dataclass(frozen=True)
class WireOutput:
    request_id: str
    finished: bool
    metrics: RequestMetrics
    completions: list[WireCompletion]
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sent once, when they are first ready


@dataclass
class CallResult:
    """The answer to a LoadLora / UnloadLora: its error (None: done) and the adapters served now."""

    call_id: int
    error: WireError | None
    lora_modules: dict[str, LoraModule]


@dataclass
class CoreBatch:
    """Everything one engine step (or one batch of commands) produced."""

    outputs: list[WireOutput] = field(default_factory=list)
    errors: list[tuple[str, WireError]] = field(default_factory=list)  # (request_id, why it was refused)
    results: list[CallResult] = field(default_factory=list)
    stats: EngineStats | None = None  # only in answer to StatsRequests, never per step
    stats_ticket: int = 0  # with stats: every StatsRequest up to this ticket is answered
    room: TenantRoom | None = None  # after a tenant-table change
    tenancy_usage: Any = None  # EngineTenancyUsage, now and then
    eviction_index: dict | None = None  # for the state store, now and then
    kv_state: Any = None  # ReplicaKVState (cached prefix hashes and load, for a router), with the eviction index
    stopped: bool = False  # the engine finished its shutdown; the process exits next


# -- errors --------------------------------------------------------------------------------------
_ERROR_KINDS: dict[str, type[Exception]] = {
    "params": SamplingParamsError, "prompt_too_long": PromptTooLongError, "duplicate": DuplicateRequestError,
    "invalid": InvalidRequestError, "shutting_down": EngineShuttingDownError, "lora_file": LoraFileError,
    "lora": LoraConfigError,
    "engine": EngineError,
}


def wire_error(error: BaseException) -> WireError:
    """The error's kind (the most specific class the server tells apart), message and param."""
    for kind, cls in _ERROR_KINDS.items():
        if isinstance(error, cls):
            return WireError(kind, str(error), getattr(error, "param", None))
    if isinstance(error, ValueError):
        return WireError("invalid", str(error))
    return WireError("engine", f"{type(error).__name__}: {error}")


def error_from_wire(error: WireError) -> Exception:
    cls = _ERROR_KINDS.get(error.kind, EngineError)
    if cls is SamplingParamsError:
        return SamplingParamsError(error.param or "", error.message)
    return cls(error.message)


# -- outputs -------------------------------------------------------------------------------------
class OutputEncoder:
    """Engine side: turns snapshots into deltas, remembering what each request's decoder holds."""

    def __init__(self) -> None:
        # request_id -> per completion index (text length, token count, logprob count); None: prompt logprobs sent
        self._sent: dict[str, dict[int, tuple[int, int, int]]] = {}
        self._prompt_logprobs_sent: set[str] = set()

    def encode(self, output: RequestOutput) -> WireOutput:
        sent = self._sent.setdefault(output.request_id, {})
        completions = [self._completion(c, sent) for c in output.outputs]
        prompt_logprobs = None
        if output.prompt_logprobs is not None and output.request_id not in self._prompt_logprobs_sent:
            prompt_logprobs = output.prompt_logprobs
            self._prompt_logprobs_sent.add(output.request_id)
        if output.finished:
            self.forget(output.request_id)
        return WireOutput(output.request_id, output.finished, output.metrics, completions, prompt_logprobs)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._prompt_logprobs_sent.discard(request_id)

    @staticmethod
    def _completion(c: CompletionOutput, sent: dict[int, tuple[int, int, int]]) -> WireCompletion:
        text_len, num_tokens, num_logprobs = sent.get(c.index, (0, 0, 0))
        logprobs = c.logprobs or []
        logprobs_delta = c.logprobs_delta or []
        grew_text = len(c.text) == text_len + len(c.text_delta) and c.text.endswith(c.text_delta)
        grew_tokens = len(c.token_ids) == num_tokens + len(c.token_ids_delta)
        grew_logprobs = len(logprobs) == num_logprobs + len(logprobs_delta)
        sent[c.index] = (len(c.text), len(c.token_ids), len(logprobs))
        return WireCompletion(
            c.index, c.text_delta, c.token_ids_delta, c.logprobs_delta, c.cumulative_logprob, c.finish_reason,
            c.stop_reason, full_text=None if grew_text else c.text,
            full_token_ids=None if grew_tokens else c.token_ids,
            full_logprobs=None if grew_logprobs else c.logprobs, has_logprobs=c.logprobs is not None)


class OutputDecoder:
    """Server side, one per request: rebuilds the engine's snapshots from the deltas."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], tenant: str) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.tenant = tenant
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._last: dict[int, CompletionOutput] = {}

    def decode(self, wire: WireOutput) -> RequestOutput:
        if wire.prompt_logprobs is not None:
            self.prompt_logprobs = wire.prompt_logprobs
        outputs = [self._completion(c) for c in wire.completions]
        return RequestOutput(self.request_id, self.prompt_token_ids, outputs, wire.finished, wire.metrics,
                             self.tenant, self.prompt_logprobs)

    def _completion(self, c: WireCompletion) -> CompletionOutput:
        last = self._last.get(c.index) or CompletionOutput(index=c.index)
        text = c.full_text if c.full_text is not None else last.text + c.text_delta
        token_ids = c.full_token_ids if c.full_token_ids is not None else last.token_ids + c.token_ids_delta
        logprobs = None
        if c.has_logprobs:
            logprobs = (c.full_logprobs if c.full_logprobs is not None
                        else (last.logprobs or []) + (c.logprobs_delta or []))
        output = CompletionOutput(index=c.index, text=text, token_ids=token_ids, text_delta=c.text_delta,
                                  token_ids_delta=c.token_ids_delta, logprobs=logprobs,
                                  logprobs_delta=c.logprobs_delta, cumulative_logprob=c.cumulative_logprob,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        self._last[c.index] = output
        return output

    def aborted(self) -> RequestOutput:
        """The final snapshot of a request the engine can no longer finish: every unfinished
        completion ends with finish_reason "abort"."""
        from sits.runtime.engine.request import FinishReason

        outputs = []
        for index in sorted(self._last):
            last = self._last[index]
            outputs.append(CompletionOutput(index=index, text=last.text, token_ids=list(last.token_ids),
                                            logprobs=last.logprobs, cumulative_logprob=last.cumulative_logprob,
                                            logprobs_delta=[] if last.logprobs is not None else None,
                                            finish_reason=last.finish_reason or FinishReason.ABORT,
                                            stop_reason=last.stop_reason))
        return RequestOutput(self.request_id, self.prompt_token_ids, outputs, True, RequestMetrics(),
                             self.tenant, self.prompt_logprobs)
