"""What crosses the pipe between the API server and the engine process, and how outputs shrink.

Both directions send one pickled list per batch (`encode` / `decode`, pickle protocol 5): the server
sends the commands gathered in one event-loop turn, the engine sends one `CoreBatch` per step.

Outputs travel as token deltas. The engine serves the server with `OutputProcessor(detokenize=False)`:
each step's snapshot of a request carries only what the step added to each completion (token ids,
logprobs) and the finish reasons the engine decides; the text is decoded, and stop strings applied,
in the server (`request_stream.py`). `OutputEncoder` turns such a snapshot into a `WireOutput` of
plain tuples, the prompt logprobs once and the prompt never, so per-step traffic and pickling stay
proportional to the tokens the step produced, never to the sequences' lengths. A stop string the
server found comes back as `StopCompletions`.

Errors cross as `WireError` (kind, message, param): exceptions with their own constructors do not
all survive pickling, and the server only needs the class that picks the HTTP status.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from sits.runtime.engine.client_base import EngineFacts
from sits.runtime.engine.errors import (
    DuplicateRequestError,
    EngineError,
    EngineShuttingDownError,
    InvalidRequestError,
    PromptTooLongError,
)
from sits.runtime.engine.request import (
    CompletionOutput,
    FinishReason,
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
class StopCompletions:
    """Completions of a request that a stop string ended in the server: stop their sequences now."""

    request_id: str
    indices: list[int]


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

    facts: EngineFacts  # tokenizer, model name, context, vocabulary, ModelInfo
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


@dataclass
class CallResult:
    """The answer to a LoadLora / UnloadLora: its error (None: done) and the adapters served now."""

    call_id: int
    error: WireError | None
    lora_modules: dict[str, LoraModule]


@dataclass
class CoreBatch:
    """Everything one engine step (or one batch of commands) produced."""

    outputs: list[WireOutput] = field(default_factory=list)  # one per request that advanced
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
# One request's step as it crosses the pipe; tuples pickle several times faster than dataclasses:
#   (request_id, finished, metrics, completions, prompt_logprobs or None)
#   metrics: (arrival_time, first_scheduled_time, first_token_time, finished_time, num_cached_prompt_tokens)
#   completions: [(index, token_ids_delta, logprobs_delta or None, finish_reason's value or None, stop_reason)]
WireOutput = tuple[str, bool, tuple, list[tuple], "list[TokenLogprob | None] | None"]


class OutputEncoder:
    """Engine side: a step's token-delta snapshot (`OutputProcessor(detokenize=False)`) as a `WireOutput`;
    a request's prompt logprobs (the same list in every snapshot) go once."""

    def __init__(self) -> None:
        self._prompt_logprobs_sent: set[str] = set()

    def encode(self, output: RequestOutput) -> WireOutput:
        request_id = output.request_id
        prompt_logprobs = None
        if output.prompt_logprobs is not None and request_id not in self._prompt_logprobs_sent:
            prompt_logprobs = output.prompt_logprobs
            self._prompt_logprobs_sent.add(request_id)
        if output.finished:
            self._prompt_logprobs_sent.discard(request_id)
        m = output.metrics
        metrics = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
                   m.num_cached_prompt_tokens)
        completions = [(c.index, c.token_ids_delta, c.logprobs_delta,
                        None if c.finish_reason is None else c.finish_reason.value, c.stop_reason)
                       for c in output.outputs]
        return request_id, output.finished, metrics, completions, prompt_logprobs


def decode_output(wire: WireOutput) -> RequestOutput:
    """Server side: the token-delta snapshot a `WireOutput` carries (its prompt is not sent: left empty)."""
    request_id, finished, metrics, completions, prompt_logprobs = wire
    outputs = [CompletionOutput(index=index, token_ids_delta=token_ids, logprobs_delta=logprobs,
                                finish_reason=None if reason is None else FinishReason(reason), stop_reason=stop)
               for index, token_ids, logprobs, reason, stop in completions]
    return RequestOutput(request_id, [], outputs, finished, RequestMetrics(*metrics), prompt_logprobs=prompt_logprobs)
