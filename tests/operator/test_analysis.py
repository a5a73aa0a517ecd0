"""The Prometheus provider and the P95-delta judgement against a real Prometheus.

One Prometheus scrapes three deployments' latency histograms: `fast` (canary as fast as stable),
`slow` (canary 200 ms slower) and `idle` (no canary traffic at all). It also loads the operator's
SitsCanaryP95Delta rule, which must fire for `slow` alone.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

import pytest
import yaml

from sits.operator.analysis import Measurement, PrometheusProvider, evaluate, run_analysis
from sits.operator.meta import Owner
from sits.operator.monitoring import ALERT_NAME, alert_rule
from sits.operator.observations import FAILED, INCONCLUSIVE, PASSED
from sits.operator.spec_rollout import AnalysisSpec
from tests.operator.helpers import wait_for
from tests.operator.latency_source import LatencySource, scrape_config, serving
from tests.support.services import free_port, prometheus_server

ANALYSIS = AnalysisSpec(prometheus_url="http://unused", max_delta_ms=50.0, interval_s=1.0, window_s=30.0,
                        timeout_s=5.0)


def owner(name: str) -> Owner:
    return Owner(name, "llm", f"uid-{name}")


@pytest.fixture(scope="module")
def prometheus():
    sources = {
        ("llm", "fast"): [LatencySource("stable", 0.020), LatencySource("canary", 0.022)],
        ("llm", "slow"): [LatencySource("stable", 0.020), LatencySource("canary", 0.200)],
        ("llm", "idle"): [LatencySource("stable", 0.020)],
    }
    rules = {"groups": [{"name": "sits", "rules": [alert_rule(owner(name), ANALYSIS)
                                                   for name in ("fast", "slow", "idle")]}]}
    config = scrape_config(sources) + "rule_files: [rules.yml]\n"
    with serving(*[s for group in sources.values() for s in group]), \
            prometheus_server(config, yaml.safe_dump(rules)) as service:
        provider = PrometheusProvider(service.url)
        # two scrapes of every target before rate() answers
        wait_for(lambda: run_analysis(provider, owner("slow"), ANALYSIS).result != INCONCLUSIVE, timeout_s=20,
                 interval_s=0.25, what="Prometheus to have two scrapes")
        wait_for(lambda: run_analysis(provider, owner("fast"), ANALYSIS).result != INCONCLUSIVE, timeout_s=10,
                 interval_s=0.25, what="the fast deployment's samples")
        yield service


def test_a_canary_as_fast_as_stable_passes(prometheus):
    outcome = run_analysis(PrometheusProvider(prometheus.url), owner("fast"), ANALYSIS)
    assert outcome.result == PASSED
    assert outcome.delta_ms == pytest.approx(0.0, abs=1.0)  # same bucket: the same interpolated quantile
    assert "<= maxDeltaMs 50 ms" in outcome.message


def test_a_slow_canary_fails_with_its_measured_delta(prometheus):
    outcome = run_analysis(PrometheusProvider(prometheus.url), owner("slow"), ANALYSIS)
    assert outcome.result == FAILED
    # P95 interpolated inside the buckets (0.15, 0.25] and (0.01, 0.025]: 245 ms - 24.25 ms
    assert outcome.delta_ms == pytest.approx(220.75, abs=1.0)
    assert "220.8 ms > maxDeltaMs 50 ms" in outcome.message


def test_no_canary_traffic_is_inconclusive(prometheus):
    outcome = run_analysis(PrometheusProvider(prometheus.url), owner("idle"), ANALYSIS)
    assert outcome.result == INCONCLUSIVE and outcome.delta_ms is None
    assert "no data" in outcome.message


def test_unreachable_prometheus_is_inconclusive():
    url = f"http://127.0.0.1:{free_port()}"
    outcome = run_analysis(PrometheusProvider(url), owner("slow"), ANALYSIS)
    assert outcome.result == INCONCLUSIVE and f"Prometheus at {url} unreachable" in outcome.message


def test_a_rejected_query_is_inconclusive(prometheus):
    measurement = PrometheusProvider(prometheus.url).run("sum(", timeout_s=5)
    assert measurement.value is None and "HTTP 400" in measurement.error and "bad_data" in measurement.error


def test_a_terminated_provider_answers_inconclusive_at_once(prometheus):
    provider = PrometheusProvider(prometheus.url)
    provider.terminate()
    assert run_analysis(provider, owner("slow"), ANALYSIS).result == INCONCLUSIVE


def test_the_alert_rule_fires_for_the_slow_canary_only(prometheus):
    def firing():
        with urllib.request.urlopen(f"{prometheus.url}/api/v1/alerts", timeout=5) as response:
            alerts = json.loads(response.read())["data"]["alerts"]
        return [a["labels"] for a in alerts if a["state"] == "firing"]
    labels = wait_for(firing, timeout_s=20, interval_s=0.25, what="SitsCanaryP95Delta to fire")
    assert [(a["alertname"], a["namespace"], a["sitsdeployment"]) for a in labels] == [(ALERT_NAME, "llm", "slow")]
    query = urllib.parse.urlencode({"query": f'ALERTS{{alertname="{ALERT_NAME}"}}'})
    with urllib.request.urlopen(f"{prometheus.url}/api/v1/query?{query}", timeout=5) as response:
        assert json.loads(response.read())["status"] == "success"


@pytest.mark.parametrize(("value", "result"), [(0.0491, PASSED), (0.0501, FAILED), (-0.2, PASSED), (None, INCONCLUSIVE)])
def test_evaluate_against_max_delta(value, result):
    assert evaluate(Measurement(value, None if value is not None else "no data"), ANALYSIS).result == result
