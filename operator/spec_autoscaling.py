"""`spec.autoscaling`: KServe-style replica bounds and scaling metrics, for a HorizontalPodAutoscaler.

The HPA scales the SitsDeployment itself through its scale subresource (it writes `spec.replicas`),
so the operator's split of replicas over the stable and canary tracks keeps working as it does for
`kubectl scale`. Defaults follow KServe's raw-deployment mode: `minReplicas` 1 and, with no
`metrics`, CPU at 80 % of the request. For an LLM server the engine's own load is the better
signal: `waitingRequests` (queue depth), `runningRequests` or `kvCacheUsage` per pod, which the
HPA reads from the custom metrics API under the runtime's metric names (a Prometheus adapter
serves them, summed over the `tenant` label per pod).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sits.operator.fields import Fields, SpecError, spec_field

# metric type -> the runtime's per-pod gauge (runtime/server/metrics.py), read as a Pods metric
POD_METRICS = {
    "waitingRequests": "sits_requests_waiting",  # sequences queued or preempted in the engine
    "runningRequests": "sits_requests_running",  # sequences in the running batch
    "kvCacheUsage": "sits_kv_cache_usage_ratio",  # fraction of KV-cache blocks held (0-1)
}
CPU = "cpu"
METRIC_TYPES = (CPU, *POD_METRICS)
DEFAULT_CPU_UTILIZATION = 80  # percent of the pods' CPU request (KServe's default)
MIN_TARGET = 0.001  # averageValue is a quantity in thousandths ("250m"); smaller would round to zero
SELECT_POLICIES = ("Max", "Min", "Disabled")
POLICY_TYPES = ("Pods", "Percent")
MAX_STABILIZATION_S = 3600  # the API server's bounds for autoscaling/v2 behavior
MAX_POLICY_PERIOD_S = 1800


@dataclass(frozen=True)
class ScalingMetric:
    """One metric: `cpu` with `target_utilization` (percent of request), else `target_average` per pod."""

    type: str
    target_utilization: int | None = None
    target_average: float | None = None


@dataclass(frozen=True)
class ScalingPolicy:
    """At most `value` pods (or percent of the current replicas) per `period_s` seconds."""

    type: str = spec_field("type", "string", choices=POLICY_TYPES)
    value: int = spec_field("value", "integer", minimum=1)
    period_s: int = spec_field("periodSeconds", "integer", minimum=1, maximum=MAX_POLICY_PERIOD_S)


@dataclass(frozen=True)
class ScalingRules:
    """One direction of the HPA's `behavior` (autoscaling/v2 HPAScalingRules); None: the HPA's default."""

    stabilization_window_s: int | None = None
    select_policy: str | None = None
    policies: tuple[ScalingPolicy, ...] | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    """Replica bounds and metrics; the HPA takes the largest replica count any metric asks for."""

    max_replicas: int
    min_replicas: int = 1
    metrics: tuple[ScalingMetric, ...] = (ScalingMetric(CPU, target_utilization=DEFAULT_CPU_UTILIZATION),)
    scale_up: ScalingRules | None = None
    scale_down: ScalingRules | None = None

    def clamp(self, replicas: int) -> int:
        """The replicas to run before the HPA's first sync: within bounds (0 stays 0: scaling is off)."""
        return 0 if replicas == 0 else min(max(replicas, self.min_replicas), self.max_replicas)


def parse_autoscaling(fields: Fields | None, cpu_requested: bool) -> AutoscalingSpec | None:
    """`spec.autoscaling`, or None when absent. `cpu_requested`: the pods have a CPU request
    (`spec.resources.requests.cpu`), without which a utilization target cannot be computed."""
    if fields is None:
        return None
    minimum = fields.integer("minReplicas", 1, minimum=1)
    maximum = fields.integer("maxReplicas", required=True, minimum=1)
    assert minimum is not None and maximum is not None  # a default, and required=True
    if maximum < minimum:
        raise SpecError(fields.at("maxReplicas"), f"must be >= minReplicas ({minimum}), got {maximum}")
    metrics = _parse_metrics(fields) if "metrics" in fields.data else AutoscalingSpec(maximum).metrics
    if not cpu_requested:
        for index, metric in enumerate(metrics):
            if metric.type == CPU:
                where = f"{fields.at('metrics')}[{index}]" if "metrics" in fields.data else fields.at("metrics")
                raise SpecError(where, "a cpu target is a percent of the pods' CPU request: set "
                                       "spec.resources.requests.cpu, or scale on waitingRequests, "
                                       "runningRequests or kvCacheUsage")
    behavior = fields.child("behavior", {"scaleUp", "scaleDown"})
    return AutoscalingSpec(
        max_replicas=maximum, min_replicas=minimum, metrics=metrics,
        scale_up=_parse_rules(behavior.child("scaleUp", _RULE_FIELDS)) if behavior else None,
        scale_down=_parse_rules(behavior.child("scaleDown", _RULE_FIELDS)) if behavior else None,
    )


def _parse_metrics(fields: Fields) -> tuple[ScalingMetric, ...]:
    items = fields.items("metrics")
    if not items:
        raise SpecError(fields.at("metrics"), "needs at least one metric (leave it out for cpu at "
                                              f"{DEFAULT_CPU_UTILIZATION} %)")
    metrics: list[ScalingMetric] = []
    for path, item in items:
        metric = Fields(item, path, {"type", "targetUtilization", "targetAverage"})
        kind = metric.string("type", required=True, choices=METRIC_TYPES)
        if any(seen.type == kind for seen in metrics):
            raise SpecError(metric.at("type"), f"{kind} appears twice")
        if kind == CPU:
            if "targetAverage" in metric.data:
                raise SpecError(metric.at("targetAverage"), "cpu takes targetUtilization (percent of the request)")
            utilization = metric.integer("targetUtilization", required=True, minimum=1, maximum=100)
            metrics.append(ScalingMetric(CPU, target_utilization=utilization))
            continue
        if "targetUtilization" in metric.data:
            raise SpecError(metric.at("targetUtilization"), f"{kind} takes targetAverage (a value per pod)")
        average = metric.number("targetAverage", required=True, minimum=MIN_TARGET,
                                maximum=1.0 if kind == "kvCacheUsage" else None)
        metrics.append(ScalingMetric(str(kind), target_average=average))
    return tuple(metrics)


_RULE_FIELDS = {"stabilizationWindowSeconds", "selectPolicy", "policies"}


def _parse_rules(fields: Fields | None) -> ScalingRules | None:
    if fields is None:
        return None
    policies: list[ScalingPolicy] | None = None
    if "policies" in fields.data:
        policies = []
        items = fields.items("policies")
        if not items:
            raise SpecError(fields.at("policies"), "needs at least one policy (leave it out for the HPA's default)")
        for path, item in items:
            policy = Fields(item, path, {"type", "value", "periodSeconds"})
            policies.append(policy.parse_into(ScalingPolicy))
    return ScalingRules(
        stabilization_window_s=fields.integer("stabilizationWindowSeconds", None, minimum=0,
                                              maximum=MAX_STABILIZATION_S),
        select_policy=fields.string("selectPolicy", None, choices=SELECT_POLICIES),
        policies=None if policies is None else tuple(policies),
    )


def rules_to_dict(rules: ScalingRules) -> dict[str, Any]:
    """autoscaling/v2 HPAScalingRules, only the fields the spec set."""
    data: dict[str, Any] = {}
    if rules.stabilization_window_s is not None:
        data["stabilizationWindowSeconds"] = rules.stabilization_window_s
    if rules.select_policy is not None:
        data["selectPolicy"] = rules.select_policy
    if rules.policies is not None:
        data["policies"] = [{"type": p.type, "value": p.value, "periodSeconds": p.period_s} for p in rules.policies]
    return data
