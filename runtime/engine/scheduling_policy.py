"""The order in which waiting sequences are admitted and running ones are preempted.

The scheduler asks its policy two questions and nothing else, so the tenancy layer can swap in
per-tenant fairness without touching the scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

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
