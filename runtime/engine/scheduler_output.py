"""What the scheduler hands the model runner each step, and what comes back.

Plain dataclasses of Python values: the scheduler never sees a tensor, and the runner never
changes scheduling state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sits.runtime.engine.request import TokenLogprob
from sits.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One sequence's share of a step.

    Attributes:
        sequence: the sequence (the runner reads its sampling params and tokens, never writes).
        token_ids: the tokens to compute this step (a prefill chunk, or the last sampled token);
            PENDING_TOKEN_ID for a token the previous step sampled whose id is not on the host yet
            (async scheduling: the runner takes it from that step's sampled ids on the device).
        start_position: position of token_ids[0] (= tokens already in the KV cache).
        block_ids: the whole block table after this step's allocation: the KV manager's own list
            (no copy), valid for this step; readers never change it.
        samples: True when this chunk reaches the end of the known tokens, so the step samples
            the next token; False for a prefill chunk that stops short of the prompt's end.
        draft_token_ids: speculative drafts (the tail of token_ids after the sequence's last
            token): the runner verifies them against the target model (`spec_verify.py`).
    """

    sequence: Sequence
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def seq_id(self) -> str:
        return self.sequence.seq_id

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's batch.

    Attributes:
        scheduled: decodes first, then prefill chunks (the runner reorders for the back end).
        num_batched_tokens: sum of the new tokens, <= max_num_batched_tokens.
        preempted: sequences that lost their KV this step (they recompute later).
        finished: sequences that finished or were aborted since the previous step.
        The runner gives the rows of both back (`InputBatch.release`) before it builds the step.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def preempted_seq_ids(self) -> list[str]:
        return [seq.seq_id for seq in self.preempted]

    @property
    def finished_seq_ids(self) -> list[str]:
        return [seq.seq_id for seq in self.finished]


@dataclass
class SampledToken:
    """The token the sampler picked for one sequence, and its logprobs when asked for."""

    token_id: int
    logprob: TokenLogprob | None = None


@dataclass
class ModelRunnerOutput:
    """Sampled tokens keyed by seq_id, for the scheduled sequences whose `samples` was True, and
    the prompt logprobs the step scored: request_id -> (position of the first scored prompt token,
    the logprobs of it and the following ones; `prompt_logprobs.py`). With speculation,
    `accepted_drafts` holds a speculating sequence's drafts the target accepted, which come before
    its sampled token (the target's correction, or its bonus token when every draft was accepted)."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SequenceUpdate:
    """What one step added to a sequence, for the output processor.

    Attributes:
        sequence: the sequence after the step (its status says whether it finished).
        new_token_ids: tokens appended this step.
        new_logprobs: their logprobs when the request asked for them.
        finished_by_token: the last token ended the sequence (EOS or a stop token id), so its
            text is not part of the completion.
    """

    sequence: Sequence
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finished_by_token: bool = False

    @property
    def status(self) -> SequenceStatus:
        return self.sequence.status
