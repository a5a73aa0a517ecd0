"""Canary analysis: metric providers behind a small interface, and the P95-delta judgement.

A provider answers one query with a `Measurement` (a value, or why there is none); it never
raises for a metric source that is down or slow, because no data is *inconclusive*: never a pass,
never an abort. `run` and `terminate` mirror Argo Rollouts' metric provider; Prometheus is the
provider we ship.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from sits.operator.meta import Owner
from sits.operator.observations import FAILED, INCONCLUSIVE, PASSED, AnalysisOutcome
from sits.operator.queries import delta_expr
from sits.operator.spec_rollout import AnalysisSpec


@dataclass(frozen=True)
class Measurement:
    """One query's answer: `value` (the query's unit; seconds for latency) or `error` saying why not."""

    value: float | None
    error: str | None = None


class MetricProvider(ABC):
    """A metric source the analysis can query (one instance per source, shared by all resources)."""

    @abstractmethod
    def run(self, query: str, timeout_s: float) -> Measurement:
        """Evaluate `query` now; returns within about `timeout_s`, never raises for source errors."""

    @abstractmethod
    def terminate(self) -> None:
        """Stop: later runs answer inconclusive at once (used when the operator shuts down)."""

    @property
    @abstractmethod
    def kind(self) -> str:
        """The provider's name, as in status messages (`prometheus`)."""


class PrometheusProvider(MetricProvider):
    """Instant queries against Prometheus's HTTP API (`GET /api/v1/query`)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._terminated = threading.Event()
        # In-cluster Prometheus is reached directly: an HTTP(S)_PROXY meant for egress must not apply
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @property
    def kind(self) -> str:
        return "prometheus"

    def terminate(self) -> None:
        self._terminated.set()

    def run(self, query: str, timeout_s: float) -> Measurement:
        if self._terminated.is_set():
            return Measurement(None, "the analysis was terminated")
        address = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        try:
            with self._opener.open(address, timeout=timeout_s) as response:
                body = json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as error:
            return Measurement(None, f"Prometheus at {self.url} answered HTTP {error.code}: {_error_text(error)}")
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            return Measurement(None, f"Prometheus at {self.url} unreachable: {reason}")
        except (ValueError, UnicodeDecodeError):
            return Measurement(None, f"Prometheus at {self.url} answered something that is not JSON")
        return _parse_vector(body)


def _error_text(error: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(error.read().decode("utf-8"))
        return f"{body.get('errorType', 'error')}: {body.get('error', '')}"
    except (ValueError, UnicodeDecodeError, OSError):
        return error.reason or "error"


def _parse_vector(body: object) -> Measurement:
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else None
        return Measurement(None, f"Prometheus query failed: {error or 'unexpected answer'}")
    data = body.get("data") or {}
    result = data.get("result")
    samples: list[Any]  # [timestamp, "value"] pairs, as Prometheus sent them (checked below)
    if data.get("resultType") == "scalar" and isinstance(result, list) and len(result) == 2:
        samples = [result]
    elif data.get("resultType") == "vector" and isinstance(result, list):
        samples = [item.get("value") for item in result if isinstance(item, dict)]
    else:
        return Measurement(None, f"Prometheus answered a {data.get('resultType')!r}, not a vector")
    if not samples:
        return Measurement(None, "no data: a track has no latency samples in the window (no traffic yet?)")
    if len(samples) > 1:
        return Measurement(None, f"the query matched {len(samples)} series, expected one")
    try:
        value = float(samples[0][1])
    except (TypeError, ValueError, IndexError):
        return Measurement(None, f"Prometheus answered an unreadable sample {samples[0]!r}")
    if not math.isfinite(value):
        return Measurement(None, "no data: a track's quantile is NaN (no requests finished in the window)")
    return Measurement(value)


def evaluate(measurement: Measurement, analysis: AnalysisSpec) -> AnalysisOutcome:
    """Passed when canary minus stable is at most maxDeltaMs; Inconclusive when nothing was measured."""
    quantile = f"P{analysis.quantile * 100:g}"
    if measurement.value is None:
        return AnalysisOutcome(INCONCLUSIVE, None, measurement.error or "no measurement")
    delta_ms = measurement.value * 1000.0
    if delta_ms > analysis.max_delta_ms:
        return AnalysisOutcome(FAILED, delta_ms,
                               f"{quantile} delta {delta_ms:.1f} ms > maxDeltaMs {analysis.max_delta_ms:g} ms")
    return AnalysisOutcome(PASSED, delta_ms,
                           f"{quantile} delta {delta_ms:.1f} ms <= maxDeltaMs {analysis.max_delta_ms:g} ms")


def run_analysis(provider: MetricProvider, owner: Owner, analysis: AnalysisSpec) -> AnalysisOutcome:
    """One P95-delta analysis run of this SitsDeployment's canary."""
    query = delta_expr(owner.namespace, owner.name, analysis.quantile, analysis.window_s)
    return evaluate(provider.run(query, analysis.timeout_s), analysis)


class ProviderRegistry:
    """One provider per metric source URL, shared by every resource that points at it."""

    def __init__(self) -> None:
        self._providers: dict[str, MetricProvider] = {}
        self._lock = threading.Lock()

    def for_analysis(self, analysis: AnalysisSpec) -> MetricProvider:
        with self._lock:
            provider = self._providers.get(analysis.prometheus_url)
            if provider is None:
                provider = self._providers[analysis.prometheus_url] = PrometheusProvider(analysis.prometheus_url)
            return provider

    def terminate_all(self) -> None:
        with self._lock:
            for provider in self._providers.values():
                provider.terminate()
            self._providers.clear()
