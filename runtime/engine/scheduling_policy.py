"""The order in which waiting sequences are admitted and running ones are preempted.

The scheduler asks a `SchedulingPolicy` whom to preempt and a `WaitingQueue` whom to admit next,
and nothing else, so the tenancy layer can swap in per-tenant fairness without touching it.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Iterator

from sits.runtime.engine.sequence import Sequence


class SchedulingPolicy(ABC):
    """Ranks sequences for admission and for preemption."""

    @abstractmethod
    def admission_key(self, seq: Sequence) -> tuple:
        """Waiting sequences are admitted smallest key first."""

    def preemption_key(self, seq: Sequence) -> tuple:
        """When blocks run out, the running sequence with the largest key is preempted first.

        Default: the lowest priority, and among equals the latest arrival.
        """
        return (-seq.priority, seq.arrival_time, seq.arrival_order)


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; priority only decides who is preempted."""

    def admission_key(self, seq: Sequence) -> tuple:
        return (seq.arrival_time, seq.arrival_order)


class PriorityPolicy(SchedulingPolicy):
    """Higher priority first, then first come, first served."""

    def admission_key(self, seq: Sequence) -> tuple:
        return (-seq.priority, seq.arrival_time, seq.arrival_order)


def make_policy(name: str) -> SchedulingPolicy:
    policies = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}
    if name not in policies:
        raise ValueError(f"unknown scheduling policy {name!r}; expected one of {', '.join(policies)}")
    return policies[name]()


class WaitingQueue(ABC):
    """The scheduler's waiting sequences, served from the head.

    The scheduler admits `peek()`, then `pop()`s it once it got its blocks; a preempted sequence
    comes back through `push_front` (next among its peers); an aborted one leaves by `remove`.
    The default orders by a `SchedulingPolicy`; the tenancy layer plugs in a fair queue.
    """

    @abstractmethod
    def push(self, seq: Sequence) -> None:
        """A new sequence."""

    @abstractmethod
    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence, to be served before newer ones."""

    @abstractmethod
    def peek(self) -> Sequence:
        """The sequence `pop` would return (only called when the queue is not empty)."""

    @abstractmethod
    def pop(self) -> Sequence:
        """Remove and return the head."""

    @abstractmethod
    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out wherever it is; False if it is not waiting."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Sequence]: ...

    def heads(self) -> Iterator[Sequence]:
        """The sequences that may be admitted next, in service order; the scheduler `take`s the
        first one that gets its blocks. One head by default (a strict order: the head waits for
        blocks and holds up the rest); a per-tenant queue yields each tenant's head, so a tenant
        whose KV shard is full does not hold up the others."""
        if len(self):
            yield self.peek()

    def take(self, seq: Sequence) -> None:
        """Remove `seq`, one of `heads()`, as `pop` would remove the head."""
        if not len(self) or self.peek() is not seq:
            raise ValueError("only a head of the waiting queue can be taken")
        self.pop()


class KeyedSequences:
    """Sequences kept sorted by `policy.admission_key` (stable for equal keys); the scheduler's
    running list and the default waiting queue.

    Attributes:
        items: the sequences in key order (read it; change it through this class only).
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._keys: list[tuple] = []
        self.items: list[Sequence] = []

    def insert(self, seq: Sequence, front: bool = False) -> None:
        """Add `seq` after the sequences of equal key (before them with `front`)."""
        key = self.policy.admission_key(seq)
        index = (bisect.bisect_left if front else bisect.bisect_right)(self._keys, key)
        self._keys.insert(index, key)
        self.items.insert(index, seq)

    def pop_first(self) -> Sequence:
        self._keys.pop(0)
        return self.items.pop(0)

    def remove(self, seq: Sequence) -> bool:
        """Take `seq` out (compared by identity); False if it is not here."""
        try:
            index = self.items.index(seq)  # a Sequence compares by identity
        except ValueError:
            return False
        del self.items[index]
        del self._keys[index]
        return True


class OrderedWaitingQueue(WaitingQueue):
    """Waiting sequences sorted by `policy.admission_key` (stable for equal keys).

    A preempted sequence keeps its key, so under FCFS it goes back ahead of everything that
    arrived after it.
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._sorted = KeyedSequences(policy)

    def push(self, seq: Sequence) -> None:
        self._sorted.insert(seq)

    def push_front(self, seq: Sequence) -> None:
        self._sorted.insert(seq, front=True)

    def peek(self) -> Sequence:
        return self._sorted.items[0]

    def pop(self) -> Sequence:
        return self._sorted.pop_first()

    def remove(self, seq: Sequence) -> bool:
        return self._sorted.remove(seq)

    def __len__(self) -> int:
        return len(self._sorted.items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._sorted.items))
