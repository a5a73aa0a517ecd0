"""The engine's WaitingQueue, fair between tenants: `FairQueue` over the scheduler's sequences.

Pass it as `Scheduler(..., waiting_queue=FairWaitingQueue(table.weights()))` (or take one from
`Tenancy.fair_queue()`, which follows live weight changes). A sequence's tier is its `priority`,
its tenant is `seq.tenant`, and serving it costs the tokens it has to compute, so a tenant
sending long prompts gets fewer turns than one sending short ones, in proportion.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from sits.runtime.engine.scheduling_policy import WaitingQueue
from sits.runtime.engine.sequence import Sequence
from sits.runtime.tenancy.fair_queue import FairQueue


def tokens_to_compute(seq: Sequence) -> float:
    """Prompt (and, after a preemption, output) tokens the sequence needs computed; at least 1."""
    return float(max(1, seq.num_tokens - seq.num_computed_tokens))


class FairWaitingQueue(WaitingQueue):
    """Priority tiers, weighted fair share between tenants of a tier, FCFS within a tenant.

    Args:
        weights: tenant -> scheduling weight (default 1.0).
        cost: what serving a sequence charges its tenant (tokens to compute by default).
    """

    def __init__(self, weights: Mapping[str, float] | None = None,
                 cost: Callable[[Sequence], float] = tokens_to_compute) -> None:
        self.queue = FairQueue(dict(weights or {}))
        self._cost = cost

    def set_weight(self, tenant: str, weight: float) -> None:
        self.queue.set_weight(tenant, weight)

    def push(self, seq: Sequence) -> None:
        self.queue.push(seq, seq.tenant, seq.priority, self._cost(seq))

    def push_front(self, seq: Sequence) -> None:
        self.queue.push_front(seq, seq.tenant, seq.priority, self._cost(seq))

    def peek(self) -> Sequence:
        return self.queue.peek()

    def pop(self) -> Sequence:
        return self.queue.pop()

    def remove(self, seq: Sequence) -> bool:
        return self.queue.remove(seq)

    def heads(self) -> Iterator[Sequence]:
        """One waiting sequence per tenant, in service order; `take` one to skip the others."""
        return self.queue.heads()

    def take(self, seq: Sequence) -> None:
        self.queue.take(seq)

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self.queue))
