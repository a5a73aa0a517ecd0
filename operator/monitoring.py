"""Pure builders for the Prometheus Operator: the ServiceMonitor and the P95-delta PrometheusRule."""

from __future__ import annotations

from typing import Any

from sits.operator.fields import format_duration
from sits.operator.meta import DEPLOYMENT_LABEL, SERVICE_ROLE_LABEL, Owner, object_meta
from sits.operator.queries import delta_expr
from sits.operator.spec_rollout import AnalysisSpec

MONITORING_API = "monitoring.coreos.com/v1"
ALERT_NAME = "SitsCanaryP95Delta"
DEFAULT_RULE_ANALYSIS = AnalysisSpec(prometheus_url="http://prometheus:9090", max_delta_ms=50.0)


def build_service_monitor(owner: Owner, interval: str = "15s") -> dict[str, Any]:
    """Scrape the stable and canary Services (not `x`, which would scrape the same pods twice) on
    their `metrics` port (the runtime's --metrics-port).

    The relabelling gives every series the `sitsdeployment` label the P95-delta query selects on.
    """
    return {
        "apiVersion": MONITORING_API, "kind": "ServiceMonitor",
        "metadata": object_meta(owner, owner.name),
        "spec": {
            "selector": {"matchLabels": {DEPLOYMENT_LABEL: owner.name},
                         "matchExpressions": [{"key": SERVICE_ROLE_LABEL, "operator": "In",
                                               "values": ["stable", "canary"]}]},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            "endpoints": [{
                "port": "metrics", "path": "/metrics", "interval": interval,
                "relabelings": [{"sourceLabels": ["__meta_kubernetes_service_label_sits_ai_deployment"],
                                 "targetLabel": "sitsdeployment"}],
            }],
        },
    }


def alert_rule(owner: Owner, analysis: AnalysisSpec | None) -> dict[str, Any]:
    """The SitsCanaryP95Delta alert: fires while canary minus stable exceeds maxDeltaMs for one interval.

    It carries the `namespace` and `sitsdeployment` labels the operator's Alertmanager webhook reads.
    """
    analysis = analysis or DEFAULT_RULE_ANALYSIS
    threshold_s = analysis.max_delta_ms / 1000.0
    expr = f"({delta_expr(owner.namespace, owner.name, analysis.quantile, analysis.window_s)}) > {threshold_s:g}"
    quantile = f"P{analysis.quantile * 100:g}"
    return {
        "alert": ALERT_NAME,
        "expr": expr,
        "for": format_duration(analysis.interval_s),
        "labels": {"severity": "warning", "namespace": owner.namespace, "sitsdeployment": owner.name},
        "annotations": {
            "summary": f"Canary {quantile} latency of {owner.namespace}/{owner.name} exceeds stable by more "
                       f"than {analysis.max_delta_ms:g} ms",
            "description": "canary minus stable: {{ $value | humanizeDuration }}",
        },
    }


def build_prometheus_rule(owner: Owner, analysis: AnalysisSpec | None) -> dict[str, Any]:
    return {
        "apiVersion": MONITORING_API, "kind": "PrometheusRule",
        "metadata": object_meta(owner, owner.name),
        "spec": {"groups": [{"name": f"sits-{owner.namespace}-{owner.name}", "rules": [alert_rule(owner, analysis)]}]},
    }
