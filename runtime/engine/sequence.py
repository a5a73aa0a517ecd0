"""One sequence, the owner of its engine-side state, and one request as the engine tracks it.

A request with `n` completions becomes `n` sequences ("children") that share the prompt; each
is scheduled, preempted and finished on its own, and the output processor gathers them back into
one `RequestOutput`. The engine keeps each request as a `RequestState` (its sequences and what the
step loop asks of it), in one index by request id.

A `Sequence` owns what the engine holds for it, so that nothing keyed by its id has to be cleaned
up in step with anything else: its KV blocks and block table (`kv_cache.py` fills and frees them),
its row of the runner's persistent batch (`input_batch.py`), its seeded random generator
(`sampler.py`), its grammar matcher (`structured_output.py`) and the siblings held back until it
computed the shared prompt (`scheduler.py`). Finishing or preempting a sequence is one call on the
scheduler (`Scheduler._finish` / `_preempt`), which frees its blocks at once and hands it to the
runner in the next `SchedulerOutput` to give its row back; what else it holds goes with it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sits.runtime.engine.request import FinishReason, SamplingParams

if TYPE_CHECKING:
    from sits.runtime.engine.eviction import KVBlock
    from sits.runtime.engine.structured_output import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted (its KV was dropped; it recomputes)
    RUNNING = "running"  # holds KV blocks; scheduled every step until it finishes
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # client gone, drain timeout, engine error

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


# Stands in a step's token ids for a token sampled by the previous step whose id has not reached the
# host yet (async scheduling); the model runner puts the real id in place on the device.
PENDING_TOKEN_ID = -1


def child_sequence_id(request_id: str, index: int, n: int) -> str:
    """The scheduler id of completion `index` of a request: the request id itself when n == 1."""
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass(eq=False)
class Sequence:
    """The growing token list of one completion and how much of it is in the KV cache.

    Attributes:
        seq_id: unique id in the scheduler and the KV cache.
        request_id: the client's request this completion belongs to.
        index: which of the request's n completions this is.
        params: sampling parameters of this child (n == 1; the seed offset by index).
        max_tokens: resolved output limit (params.max_tokens, or what max_model_len leaves).
        tenant, priority: who asked and how much it matters (higher priority is served first
            and preempted last); the tenancy layer reads them for shards and eviction scores.
        cache_salt: mixed into the first block's prefix hash so tenants never share cached KV
            unless they share the salt.
        lora_name, lora_slot: the LoRA adapter's prefix-cache key (its name; with a per-load id for an
            adapter loaded at runtime, `LoraManager.cache_keys`) and its slot in the model's adapter
            stacks (None and 0: the base model); the key keeps its prefix hashes apart.
        num_computed_tokens: tokens whose K/V are in the cache or being computed by a step already
            scheduled (the scheduler advances it when it schedules them; prefix hits count).
        num_pending_tokens: tokens already scheduled to be sampled whose ids have not reached the
            host yet (`update_from_output` appends them). 0 or 1 between steps of a synchronous
            engine; with async scheduling the next step is scheduled while one is still pending,
            and its input token is taken from the previous step's sampled ids on the device.
        block_hashes: prefix hashes of the full blocks of all_token_ids, extended lazily.
        sibling_ids: seq_ids of the other completions of the same request (n > 1).

    What it holds (each written by one owner, all dropped with the sequence):
        blocks, block_ids: its KV block table, as blocks and as physical ids in token order
            (`KVCacheManager`; `block_ids` is grown in place while the sequence holds blocks, and
            is a new list after `free`, so a reader can tell a new table by identity).
        num_cached_blocks: leading blocks of the table already made findable by prefix hashes.
        batch_row: its row of the runner's persistent batch (`InputBatch`), None when it has none.
        generator: its own torch.Generator when its params give a seed (`Sampler`, made on its
            first draw); it lives across preemption and goes with the sequence.
        grammar: its matcher under a response_format (`StructuredOutputs`), None otherwise.
        held_siblings, held_by: completions 1..n-1 wait on completion 0 (the leader) until it has
            computed the shared prompt's full blocks (`Scheduler`); the leader lists them, each
            names its leader.
    """

    seq_id: str
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    tenant: str = "default"
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_slot: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    stop_reason: str | int | None = None
    sibling_ids: tuple[str, ...] = ()
    arrival_order: int = 0  # tie-breaker: the order add_request saw requests
    blocks: list[KVBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    batch_row: Any = None
    generator: Any = None
    grammar: SequenceGrammar | None = None
    held_siblings: list[Sequence] = field(default_factory=list)
    held_by: Sequence | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens (known or pending) whose K/V no scheduled step computes yet."""
        return len(self.all_token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def num_outputs_before_sample(self) -> int:
        """Output tokens generated before the one a step is sampling now (for min_tokens): the
        known ones plus those still pending, less the one being sampled (pending once scheduled)."""
        return len(self.output_token_ids) + max(0, self.num_pending_tokens - 1)

    @property
    def is_prefilling(self) -> bool:
        """More than one token still lacks K/V: the sequence is (re)computing its context."""
        return self.num_uncomputed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass(eq=False)
class RequestState:
    """One request in the engine: its sequences and what the step loop needs to know of it.

    Attributes:
        request_id: the client's id (the engine's one index is keyed by it).
        sequences: its n completions, in index order.
        needs_history: sampling needs every output token on the host (penalties, a grammar, bad
            words of several tokens): the engine does not run a step ahead while it runs.
        scheduled: a step has scheduled one of its sequences (first_scheduled_time is stamped).
    """

    request_id: str
    sequences: list[Sequence]
    needs_history: bool = False
    scheduled: bool = False
