"""The scheduler contract: what the engine loop may ask of any scheduler.

One step of the engine is:
    output = scheduler.schedule()                        # who runs, how many tokens each
    runner_output = runner.execute(output)               # model + sampler
    updates = scheduler.update_from_output(output, runner_output)
(with async scheduling the next `schedule()` comes before this step's `update_from_output`),
and, between steps, `add_request` / `finish_requests` from the client side. A scheduler speaks
in `Sequence`s and token counts; it owns the KV-cache manager and never touches a tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from sits.runtime.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput, SequenceUpdate
from sits.runtime.engine.sequence import Sequence, SequenceStatus
from sits.runtime.engine.stats import EngineStats


class SchedulerInterface(ABC):
    @abstractmethod
    def add_request(self, seq: Sequence) -> None:
        """Queue a new sequence (WAITING). Its id must be new; validation happened before."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch within the token and sequence budgets.

        Running sequences come first (decodes, then unfinished prefills), then waiting ones are
        admitted in policy order while blocks and budget last. When the KV cache has no room
        for a running sequence, the lowest-ranked running sequence is preempted (its blocks are
        freed and it recomputes later); this never fails for lack of blocks. The scheduled tokens
        count as computed from now on, and a token the step will sample as pending, so the next
        step may be scheduled before this one's output is recorded (async scheduling).
        """

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[SequenceUpdate]:
        """Record the step: append sampled tokens, cache full blocks, finish sequences that hit
        EOS, a stop token id, max_tokens or max_model_len, or whose grammar ended (decided in
        `stopping.py`). Steps are recorded in the order they were scheduled, at most one step
        behind `schedule`.

        Returns one update per sequence that received a token, finished ones included.
        """

    @abstractmethod
    def finish_requests(self, seq_ids: str | Iterable[str], status: SequenceStatus) -> list[Sequence]:
        """Finish sequences from outside the step (abort, stop string): free their blocks now.

        Unknown or already finished ids are ignored. Returns the sequences finished by this call.
        """

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """True while any sequence is waiting or running."""

    @abstractmethod
    def get_sequence(self, seq_id: str) -> Sequence | None:
        """The unfinished sequence with this id, or None."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """The scheduler's part of the engine's figures, built now: queue lengths, KV-cache usage and
        cumulative counters (the engine's own counters are left 0; `LLMEngine.stats` adds them)."""
