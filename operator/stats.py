"""Rollout statistics: what the reconciler decided, kept as a snapshot for the metrics to read.

The reconciler records each resource's status after writing it (`record`), counts what its
decisions did (canaries promoted, canaries aborted and why) and the reconciles that failed; the
Prometheus collector (metrics.py) only ever reads `snapshot()`, an immutable copy. `forget` drops
a deleted SitsDeployment, so its series disappear from the next scrape.

Counters live in this process: an operator restart starts them at 0, which Prometheus' `rate()`
and `increase()` read as a counter reset.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from sits.operator.rollout_commands import ABORTED
from sits.operator.status import Status

# Why a canary was aborted, as the metrics label it; keyed by the RolledBack condition's reason
ABORT_ANALYSIS, ABORT_ALERT, ABORT_MANUAL = "analysis", "alert", "manual"
ABORT_REASONS = (ABORT_ANALYSIS, ABORT_ALERT, ABORT_MANUAL)
_ABORT_REASON_OF_CONDITION = {"AnalysisFailed": ABORT_ANALYSIS, "AlertFiring": ABORT_ALERT}
PROMOTED_EVENT, ROLLED_BACK_EVENT = "Promoted", "RolledBack"


@dataclass(frozen=True)
class RolloutSnapshot:
    """One SitsDeployment as last reconciled by this process.

    Attributes:
        phase: status.phase (Pending | Progressing | Paused | Healthy | Degraded | RolledBack).
        canary_weight: percent of traffic on the canary (0 without one).
        analysis_delta_ms: the last measured canary-minus-stable latency quantile, milliseconds
            (None until an analysis run measured one).
        aborts: canaries aborted since this process started, by reason (analysis | alert | manual).
        promotions: canaries promoted to stable since this process started.
    """

    namespace: str
    name: str
    phase: str | None
    canary_weight: int
    analysis_delta_ms: float | None
    aborts: tuple[tuple[str, int], ...]
    promotions: int


@dataclass(frozen=True)
class OperatorSnapshot:
    rollouts: tuple[RolloutSnapshot, ...]
    reconcile_errors: int  # reconciles that raised (API errors), all resources together


@dataclass
class _Rollout:
    phase: str | None = None
    canary_weight: int = 0
    analysis_delta_ms: float | None = None
    aborts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ABORT_REASONS, 0))
    promotions: int = 0


def abort_reason(status: Status) -> str:
    """analysis or alert: from the RolledBack condition the abort set (abort requests come from alerts)."""
    condition = status.condition("RolledBack") or {}
    return _ABORT_REASON_OF_CONDITION.get(str(condition.get("reason")), ABORT_ALERT)


class RolloutStats:
    """Thread-safe: reconciles run on kopf's handler threads and the webhook's, scrapes on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rollouts: dict[tuple[str, str], _Rollout] = {}
        self._reconcile_errors = 0

    def record(self, namespace: str, name: str, status: Status, event_reasons: Iterable[str] = ()) -> None:
        """The status just written for this resource, and the reasons of the Events its decision posted."""
        with self._lock:
            rollout = self._rollouts.setdefault((namespace, name), _Rollout())
            rollout.phase = status.phase
            rollout.canary_weight = status.canary_weight
            rollout.analysis_delta_ms = status.analysis.last_delta_ms
            for reason in event_reasons:
                if reason == PROMOTED_EVENT:
                    rollout.promotions += 1
                elif reason == ROLLED_BACK_EVENT:
                    rollout.aborts[abort_reason(status)] += 1
                elif reason == ABORTED:  # sits.ai/abort
                    rollout.aborts[ABORT_MANUAL] += 1

    def record_error(self) -> None:
        with self._lock:
            self._reconcile_errors += 1

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._rollouts.pop((namespace, name), None)

    def snapshot(self) -> OperatorSnapshot:
        with self._lock:
            rollouts = tuple(
                RolloutSnapshot(namespace=namespace, name=name, phase=r.phase, canary_weight=r.canary_weight,
                                analysis_delta_ms=r.analysis_delta_ms, aborts=tuple(sorted(r.aborts.items())),
                                promotions=r.promotions)
                for (namespace, name), r in sorted(self._rollouts.items()))
            return OperatorSnapshot(rollouts=rollouts, reconcile_errors=self._reconcile_errors)
