"""Pure builders of the traffic side: Services, the weighted HTTPRoute and the PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from sits.operator.meta import (
    DEPLOYMENT_LABEL,
    METRICS_PORT,
    SERVICE_PORT,
    SERVICE_ROLE_LABEL,
    TRACK_LABEL,
    Owner,
    object_meta,
    service_name,
)
from sits.operator.plan import Plan
from sits.operator.router_workloads import ROUTER_LABEL
from sits.operator.spec_rollout import GatewayAPISpec

HTTP_ROUTE_API = "gateway.networking.k8s.io/v1"


def build_services(owner: Owner, router: bool = False) -> list[dict[str, Any]]:
    """`x` selects both tracks; `x-stable` and `x-canary` one each (the HTTPRoute's backends).

    With `router` (spec.router.enabled), `x` selects the router pods instead, which find the
    runtime pods through `x-stable` and `x-canary`.

    Port `http` (80) serves the API; `x-stable` and `x-canary` also carry port `metrics` (the
    runtime's METRICS_PORT), which the ServiceMonitors scrape and no route sends traffic to.
    """
    services = []
    for track in (None, "stable", "canary"):
        selector = {DEPLOYMENT_LABEL: owner.name}
        if track is not None:
            selector[TRACK_LABEL] = track
        elif router:
            selector = {ROUTER_LABEL: owner.name}
        labels = {SERVICE_ROLE_LABEL: track or "all"}
        if track is not None:
            labels[TRACK_LABEL] = track
        ports = [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]
        if track is not None:
            ports.append({"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"})
        services.append({
            "apiVersion": "v1", "kind": "Service",
            "metadata": object_meta(owner, service_name(owner.name, track), labels),
            "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
        })
    return services


def _backend(owner: Owner, track: str, weight: int) -> dict[str, Any]:
    return {"group": "", "kind": "Service", "name": service_name(owner.name, track), "port": SERVICE_PORT,
            "weight": weight}


def build_http_route(owner: Owner, gateway: GatewayAPISpec, plan: Plan, canary_tenants: tuple[str, ...]) -> dict[str, Any]:
    """Weighted backends stable/canary; while a canary runs, the listed tenants' header goes to it alone."""
    weight = plan.canary_weight if plan.canary_active else 0
    rules: list[dict[str, Any]] = []
    if plan.canary_active and canary_tenants and plan.canary.replicas > 0:
        matches = [{"headers": [{"type": "Exact", "name": gateway.tenant_header, "value": tenant}]}
                   for tenant in canary_tenants]
        rules.append({"matches": matches, "backendRefs": [_backend(owner, "canary", 100)]})
    rules.append({"backendRefs": [_backend(owner, "stable", 100 - weight), _backend(owner, "canary", weight)]})
    spec: dict[str, Any] = {"rules": rules}
    if gateway.parent_refs:
        spec["parentRefs"] = [dict(ref) for ref in gateway.parent_refs]
    if gateway.hostnames:
        spec["hostnames"] = list(gateway.hostnames)
    return {"apiVersion": HTTP_ROUTE_API, "kind": "HTTPRoute",
            "metadata": object_meta(owner, gateway.http_route), "spec": spec}


def build_pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    """At most one pod of either track evicted at a time (a drain never takes all replicas)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_meta(owner, owner.name),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {DEPLOYMENT_LABEL: owner.name}}}}
