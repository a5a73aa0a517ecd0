"""Pure builder of the HorizontalPodAutoscaler that scales a SitsDeployment (`spec.autoscaling`).

Its `scaleTargetRef` is the SitsDeployment, not a Deployment: the HPA reads the pods through the
CRD's scale subresource (`status.selector` matches both tracks' pods, `status.replicas` counts
them) and writes `spec.replicas`, which the operator splits over the stable and canary tracks.
An HPA on the stable Deployment would fight the operator, which sets that Deployment's replicas.
"""

from __future__ import annotations

from typing import Any

from sits.operator.meta import API_VERSION, KIND, Owner, object_meta
from sits.operator.spec_autoscaling import CPU, POD_METRICS, AutoscalingSpec, ScalingMetric, rules_to_dict

HPA_API = "autoscaling/v2"
HPA_KIND = "HorizontalPodAutoscaler"


def quantity(value: float) -> str:
    """A Kubernetes quantity for a per-pod average: whole numbers as is, else thousandths (0.75 -> 750m)."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def metric_spec(metric: ScalingMetric) -> dict[str, Any]:
    """One autoscaling/v2 MetricSpec: a Resource utilization for cpu, else a Pods average value."""
    if metric.type == CPU:
        return {"type": "Resource",
                "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                       "averageUtilization": metric.target_utilization}}}
    assert metric.target_average is not None  # parse_autoscaling requires it for every Pods metric
    return {"type": "Pods",
            "pods": {"metric": {"name": POD_METRICS[metric.type]},
                     "target": {"type": "AverageValue", "averageValue": quantity(metric.target_average)}}}


def build_horizontal_pod_autoscaler(owner: Owner, autoscaling: AutoscalingSpec) -> dict[str, Any]:
    """HPA `x` scaling SitsDeployment `x` between min and max replicas on the spec's metrics."""
    spec: dict[str, Any] = {
        "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name},
        "minReplicas": autoscaling.min_replicas,
        "maxReplicas": autoscaling.max_replicas,
        "metrics": [metric_spec(metric) for metric in autoscaling.metrics],
    }
    behavior = {direction: rules_to_dict(rules)
                for direction, rules in (("scaleUp", autoscaling.scale_up), ("scaleDown", autoscaling.scale_down))
                if rules is not None}
    if behavior:
        spec["behavior"] = behavior
    return {"apiVersion": HPA_API, "kind": HPA_KIND, "metadata": object_meta(owner, owner.name), "spec": spec}
