"""The operator's Prometheus metrics, read from the rollout statistics' snapshot at scrape time.

Per SitsDeployment (labels `namespace`, `sitsdeployment`):
- `sits_rollout_phase{phase}`: 1 for the current phase, 0 for every other phase (kube-state-metrics'
  shape for pod phases), so `sits_rollout_phase == 1` selects one series per resource;
- `sits_rollout_canary_weight`: percent of traffic on the canary;
- `sits_rollout_analysis_delta_ms`: the last measured canary-minus-stable latency quantile (P95 by
  default), milliseconds; absent until an analysis run measured one;
- `sits_rollout_aborts_total{reason}` (analysis | alert | manual: `sits.ai/abort`) and `sits_rollout_promotions_total`;
and `sits_operator_reconcile_errors_total`, reconciles that raised (the Kubernetes API failed).
The process collectors (CPU, memory, open files, GC) come along in the same registry.

Nothing here keeps state: `build_registry` wraps a snapshot function in a registry of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sits.operator.stats import OperatorSnapshot
from sits.operator.status import PHASES

RESOURCE_LABELS = ["namespace", "sitsdeployment"]


class RolloutCollector(Collector):
    """Builds every operator metric from one `snapshot()` per scrape."""

    def __init__(self, snapshot: Callable[[], OperatorSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        return self._families(OperatorSnapshot(rollouts=(), reconcile_errors=0))

    def collect(self) -> Iterator[Metric]:
        return self._families(self._snapshot())

    @staticmethod
    def _families(snapshot: OperatorSnapshot) -> Iterator[Metric]:
        phase = GaugeMetricFamily("sits_rollout_phase", "The SitsDeployment's status.phase: 1 for the current "
                                  "phase, 0 for the others", labels=[*RESOURCE_LABELS, "phase"])
        weight = GaugeMetricFamily("sits_rollout_canary_weight", "Percent of traffic the canary gets "
                                   "(status.canaryWeight)", labels=RESOURCE_LABELS)
        delta = GaugeMetricFamily("sits_rollout_analysis_delta_ms", "The last measured canary minus stable "
                                  "latency quantile (P95 by default), milliseconds", labels=RESOURCE_LABELS)
        aborts = CounterMetricFamily("sits_rollout_aborts", "Canaries rolled back, by reason: a failed analysis, "
                                     "a firing alert or a manual abort", labels=[*RESOURCE_LABELS, "reason"])
        promotions = CounterMetricFamily("sits_rollout_promotions", "Canaries promoted to stable",
                                         labels=RESOURCE_LABELS)
        for rollout in snapshot.rollouts:
            resource = [rollout.namespace, rollout.name]
            for name in PHASES:
                phase.add_metric([*resource, name], 1.0 if rollout.phase == name else 0.0)
            weight.add_metric(resource, float(rollout.canary_weight))
            if rollout.analysis_delta_ms is not None:
                delta.add_metric(resource, rollout.analysis_delta_ms)
            for reason, count in rollout.aborts:
                aborts.add_metric([*resource, reason], float(count))
            promotions.add_metric(resource, float(rollout.promotions))
        errors = CounterMetricFamily("sits_operator_reconcile_errors", "Reconciles that failed (the Kubernetes "
                                     "API refused or could not be reached); retried on the next trigger",
                                     value=float(snapshot.reconcile_errors))
        yield from (phase, weight, delta, aborts, promotions, errors)


def build_registry(snapshot: Callable[[], OperatorSnapshot]) -> CollectorRegistry:
    """A registry of the operator's own (not prometheus_client's global one) with the rollout metrics
    and the process collectors."""
    registry = CollectorRegistry()
    registry.register(RolloutCollector(snapshot))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
