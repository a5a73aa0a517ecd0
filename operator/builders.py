"""Every object one SitsDeployment owns, from its spec and the rollout's plan (pure, no cluster).

The `build_*` functions live by concern in workloads.py, networking.py, monitoring.py and
autoscaling.py; this module gathers them so a reconcile applies one list, and names the optional
kinds it must delete when the spec stops asking for them.
"""

from __future__ import annotations

from typing import Any

from sits.operator.autoscaling import HPA_API, HPA_KIND, build_horizontal_pod_autoscaler
from sits.operator.meta import Owner
from sits.operator.monitoring import build_prometheus_rule, build_service_monitor
from sits.operator.networking import build_http_route, build_pod_disruption_budget, build_services
from sits.operator.plan import Plan
from sits.operator.router_workloads import ROUTER_KINDS, build_router_objects
from sits.operator.spec import SitsDeploymentSpec
from sits.operator.tenants import TenantRecord
from sits.operator.workloads import build_config_map, build_deployment, build_pod_template

# (apiVersion, kind) of the objects a spec may or may not ask for; absent from build_all -> deleted.
OPTIONAL_KINDS = (
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    (HPA_API, HPA_KIND),
)
# Kinds the reconciler lists and prunes (owned objects of these kinds absent from build_all are
# deleted): the optional kinds and the router's (spec.router turned off).
PRUNED_KINDS = (*OPTIONAL_KINDS, *(kind for kind in ROUTER_KINDS if kind not in OPTIONAL_KINDS))

__all__ = [
    "OPTIONAL_KINDS", "PRUNED_KINDS", "build_all", "build_config_map", "build_deployment", "build_horizontal_pod_autoscaler",
    "build_http_route", "build_pod_disruption_budget", "build_pod_template", "build_prometheus_rule", "build_service_monitor",
    "build_services",
]


def build_all(owner: Owner, spec: SitsDeploymentSpec, plan: Plan,
              tenants: list[TenantRecord] | None) -> list[dict[str, Any]]:
    """The desired objects, in apply order: config first, then pods, then what routes to them."""
    objects = [build_config_map(owner, plan, tenants if spec.tenancy.tenants else None),
               build_deployment(owner, "stable", plan.stable),
               build_deployment(owner, "canary", plan.canary),
               *build_services(owner, router=spec.router.enabled),
               build_pod_disruption_budget(owner)]
    objects += build_router_objects(owner, spec, plan)
    if spec.rollout.gateway_api is not None:
        objects.append(build_http_route(owner, spec.rollout.gateway_api, plan, spec.rollout.canary.tenants))
    if spec.monitoring.service_monitor:
        objects.append(build_service_monitor(owner))
    if spec.monitoring.prometheus_rule:
        objects.append(build_prometheus_rule(owner, spec.rollout.canary.analysis))
    if spec.autoscaling is not None:
        objects.append(build_horizontal_pod_autoscaler(owner, spec.autoscaling))
    return objects
