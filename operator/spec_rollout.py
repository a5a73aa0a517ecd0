"""The rollout and monitoring parts of the SitsDeployment spec (see spec.py for the rest)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sits.operator.fields import Fields, SpecError, spec_field

HTTP_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")
RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


@dataclass(frozen=True)
class CanaryStep:
    """Exactly one of: shift `set_weight` percent of traffic to the canary, or pause.

    A pause with `pause_seconds` None waits until resumed (annotation `sits.ai/resume`).
    """

    set_weight: int | None = None
    pause: bool = False
    pause_seconds: float | None = None

    def describe(self) -> str:
        if self.set_weight is not None:
            return f"setWeight {self.set_weight}"
        return f"pause {self.pause_seconds:g}s" if self.pause_seconds is not None else "pause until resumed"


@dataclass(frozen=True)
class AnalysisSpec:
    """The P95-delta check: canary quantile minus stable quantile, in milliseconds, every interval."""

    prometheus_url: str  # analysis.prometheus.url
    max_delta_ms: float = spec_field("maxDeltaMs", "number", minimum=0.0)
    quantile: float = spec_field("quantile", "number", 0.95, minimum=0.0, maximum=1.0,
                                 exclusive_minimum=True, exclusive_maximum=True)
    interval_s: float = spec_field("interval", "duration", 60.0, minimum=1.0)
    failure_limit: int = spec_field("failureLimit", "integer", 2, minimum=1)
    inconclusive_limit: int = spec_field("inconclusiveLimit", "integer", 3, minimum=1)
    window_s: float = spec_field("window", "duration", 300.0, minimum=1.0)
    timeout_s: float = spec_field("timeout", "duration", 10.0, minimum=0.1)


@dataclass(frozen=True)
class CanarySpec:
    steps: tuple[CanaryStep, ...] = ()
    tenants: tuple[str, ...] = ()
    analysis: AnalysisSpec | None = None


@dataclass(frozen=True)
class GatewayAPISpec:
    """An HTTPRoute the operator owns; `parent_refs` are passed through as Gateway API spells them."""

    http_route: str
    parent_refs: tuple[tuple[tuple[str, Any], ...], ...] = ()
    hostnames: tuple[str, ...] = ()
    tenant_header: str = "x-sits-tenant"


@dataclass(frozen=True)
class RolloutSpec:
    canary: CanarySpec = field(default_factory=CanarySpec)
    gateway_api: GatewayAPISpec | None = None


@dataclass(frozen=True)
class MonitoringSpec:
    service_monitor: bool = False
    prometheus_rule: bool = False


def parse_rollout(fields: Fields | None) -> RolloutSpec:
    if fields is None:
        return RolloutSpec()
    canary = fields.child("canary", {"steps", "tenants", "analysis"})
    traffic = fields.child("trafficRouting", {"gatewayAPI"})
    gateway = traffic.child("gatewayAPI", {"httpRoute", "parentRefs", "hostnames", "tenantHeader"}) if traffic else None
    return RolloutSpec(canary=_parse_canary(canary), gateway_api=_parse_gateway(gateway))


def parse_monitoring(fields: Fields | None) -> MonitoringSpec:
    if fields is None:
        return MonitoringSpec()
    return MonitoringSpec(service_monitor=fields.boolean("serviceMonitor", False),
                          prometheus_rule=fields.boolean("prometheusRule", False))


def _parse_canary(fields: Fields | None) -> CanarySpec:
    if fields is None:
        return CanarySpec()
    steps = []
    for path, item in fields.items("steps"):
        step = Fields(item, path, {"setWeight", "pause"})
        if len(step.data) != 1:
            raise SpecError(path, "each step is exactly one of setWeight or pause")
        if "setWeight" in step.data:
            steps.append(CanaryStep(set_weight=step.integer("setWeight", required=True, minimum=0, maximum=100)))
        else:
            pause = step.child("pause", {"duration"}) or Fields({}, step.at("pause"))
            steps.append(CanaryStep(pause=True, pause_seconds=pause.duration("duration", None)))
    tenants = []
    for path, item in fields.items("tenants"):
        if not isinstance(item, str) or not item:
            raise SpecError(path, f"must be a tenant name, got {item!r}")
        tenants.append(item)
    analysis = fields.child("analysis", {"prometheus", "quantile", "maxDeltaMs", "interval", "failureLimit",
                                         "inconclusiveLimit", "window", "timeout"})
    return CanarySpec(steps=tuple(steps), tenants=tuple(tenants), analysis=_parse_analysis(analysis))


def _parse_analysis(fields: Fields | None) -> AnalysisSpec | None:
    if fields is None:
        return None
    prometheus = fields.child("prometheus", {"url"}, required=True)
    assert prometheus is not None
    url = prometheus.string("url", required=True, pattern=HTTP_URL, what="an http(s):// URL")
    return fields.parse_into(AnalysisSpec, prometheus_url=url)


def _parse_gateway(fields: Fields | None) -> GatewayAPISpec | None:
    if fields is None:
        return None
    parent_refs = []
    for path, item in fields.items("parentRefs"):
        ref = Fields(item, path, {"group", "kind", "name", "namespace", "sectionName", "port"})
        ref.string("name", required=True)
        parent_refs.append(tuple(sorted(ref.data.items())))
    hostnames = []
    for path, item in fields.items("hostnames"):
        if not isinstance(item, str) or not item:
            raise SpecError(path, f"must be a host name, got {item!r}")
        hostnames.append(item)
    return GatewayAPISpec(
        http_route=fields.string("httpRoute", required=True, pattern=RESOURCE_NAME, what="an HTTPRoute name"),
        parent_refs=tuple(parent_refs),
        hostnames=tuple(hostnames),
        tenant_header=fields.string("tenantHeader", "x-sits-tenant", pattern=HEADER_NAME, what="an HTTP header name"),
    )
