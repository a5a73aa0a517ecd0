"""The PromQL both the analysis and the alert rule ask: canary quantile minus stable quantile.

Series are `sits_request_latency_seconds` histograms (labels model, tenant, track), scraped with
the target labels `namespace` and `sitsdeployment` (the ServiceMonitor's relabelling adds the latter).
"""

from __future__ import annotations

from sits.operator.fields import format_duration

LATENCY_METRIC = "sits_request_latency_seconds"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def quantile_expr(namespace: str, name: str, track: str, quantile: float, window_s: float) -> str:
    """The latency quantile of one track over the window, in seconds (one series, or none)."""
    selector = (f'namespace="{_escape(namespace)}",sitsdeployment="{_escape(name)}",track="{track}"')
    return (f"histogram_quantile({quantile:g}, sum by (namespace, sitsdeployment, le) "
            f"(rate({LATENCY_METRIC}_bucket{{{selector}}}[{format_duration(window_s)}])))")


def delta_expr(namespace: str, name: str, quantile: float, window_s: float) -> str:
    """Canary quantile minus stable quantile, in seconds; empty when either track has no traffic."""
    canary = quantile_expr(namespace, name, "canary", quantile, window_s)
    stable = quantile_expr(namespace, name, "stable", quantile, window_s)
    return f"{canary} - on (namespace, sitsdeployment) {stable}"
