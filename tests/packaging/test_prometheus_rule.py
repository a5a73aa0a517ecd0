"""The chart's SitsCanaryP95Delta: the operator's own rule, generalised; promtool checks and unit-tests it.

The chart's rule is `sits.operator.monitoring.alert_rule` with the one-resource selector
(`namespace="X",sitsdeployment="Y"`) widened to every SitsDeployment, so the two cannot drift.
`promtool test rules` then feeds both rules latency histograms of a slow canary and a healthy
one and checks that the alert fires for the slow one only, carrying the `namespace` and
`sitsdeployment` labels the operator's Alertmanager webhook reads.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from sits.operator.fields import parse_duration
from sits.operator.meta import Owner
from sits.operator.monitoring import ALERT_NAME, alert_rule, build_prometheus_rule
from sits.operator.spec_rollout import AnalysisSpec
from tests.packaging.chart import FULL_VALUES, chart, load_values, objects, one
from tests.support.services import require_binary

ONE_RESOURCE = 'namespace="__NS__",sitsdeployment="__NAME__",'
EVERY_RESOURCE = 'sitsdeployment!="",'
VALUE_SETS = {"default": {"prometheusRule": {"enabled": True}}, "full": load_values(FULL_VALUES)}
BUCKETS = ("0.025", "0.05", "0.1", "0.15", "+Inf")
# Cumulative requests per minute at or under each bucket: stable answers in 25-50 ms, a slow canary
# in 100-150 ms (its quantiles are ~100 ms above stable's), a healthy canary like stable.
FAST = (0, 600, 600, 600, 600)
SLOW = (0, 0, 0, 600, 600)


def chart_rule(values: dict) -> tuple[dict, dict]:
    """(the rendered rule, the chart's merged prometheusRule values)."""
    rule_object = one(objects(values), "PrometheusRule")
    (group,) = rule_object["spec"]["groups"]
    (rule,) = group["rules"]
    return rule, chart().merge_values(values)["prometheusRule"]


def analysis_of(settings: dict) -> AnalysisSpec:
    return AnalysisSpec(prometheus_url="http://prometheus:9090", max_delta_ms=float(settings["maxDeltaMs"]),
                        quantile=float(settings["quantile"]), window_s=parse_duration(settings["window"], "window"),
                        interval_s=parse_duration(settings["for"], "for"))


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_chart_rule_is_the_operator_rule_for_every_sitsdeployment(name):
    rule, settings = chart_rule(VALUE_SETS[name])
    operator_rule = alert_rule(Owner(name="__NAME__", namespace="__NS__", uid=""), analysis_of(settings))
    assert operator_rule["expr"].count(ONE_RESOURCE) == 2, "the operator's selector changed: update this test"
    assert rule["alert"] == operator_rule["alert"] == ALERT_NAME
    assert rule["expr"] == operator_rule["expr"].replace(ONE_RESOURCE, EVERY_RESOURCE)
    assert rule["for"] == operator_rule["for"]
    # The operator pins namespace and sitsdeployment as static labels; the chart's rule must not
    # (they come from the series), and keeps the rest
    assert operator_rule["labels"] == {"severity": "warning", "namespace": "__NS__", "sitsdeployment": "__NAME__"}
    assert rule["labels"] == {"severity": settings["severity"]}


def series(namespace: str, name: str, track: str, per_minute: tuple[int, ...]) -> list[dict]:
    return [{"series": f'sits_request_latency_seconds_bucket{{namespace="{namespace}",sitsdeployment="{name}",'
                       f'track="{track}",model="m",tenant="default",le="{le}"}}',
             "values": f"0+{count}x30"} for le, count in zip(BUCKETS, per_minute, strict=True)]


def expected_delta_s(quantile: float) -> float:
    """Canary minus stable quantile, by histogram_quantile's linear interpolation inside a bucket."""
    return (0.1 + 0.05 * quantile) - (0.025 + 0.025 * quantile)


def humanize_ms(seconds: float) -> str:
    return f"{seconds * 1000:.4g}ms"


def run_promtool(tmp_path: Path, groups: list[dict], tests: list[dict]) -> None:
    promtool = require_binary("promtool")
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": groups}))
    checked = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    test_file = tmp_path / "rules_test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [rules_file.name], "evaluation_interval": "1m",
                                         "tests": tests}))
    tested = subprocess.run([promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def latency_series() -> list[dict]:
    return (series("llm", "slow", "stable", FAST) + series("llm", "slow", "canary", SLOW)
            + series("llm", "healthy", "stable", FAST) + series("llm", "healthy", "canary", FAST)
            + series("other", "slow", "stable", FAST) + series("other", "slow", "canary", FAST))


@pytest.mark.parametrize("name", VALUE_SETS)
def test_promtool_checks_the_chart_rule_and_it_fires_for_the_slow_canary_only(tmp_path, name):
    rule_object = one(objects(VALUE_SETS[name]), "PrometheusRule")
    _rule, settings = chart_rule(VALUE_SETS[name])
    delta = expected_delta_s(settings["quantile"])
    assert delta * 1000 > settings["maxDeltaMs"], "the fixture's canary must be slow enough to fire"
    quantile = f"P{settings['quantile'] * 100:g}"
    fired = {"exp_labels": {"severity": settings["severity"], "namespace": "llm", "sitsdeployment": "slow"},
             "exp_annotations": {
                 "summary": f"Canary {quantile} latency of llm/slow exceeds stable by more than "
                            f"{settings['maxDeltaMs']:g} ms",
                 "description": f"canary minus stable: {humanize_ms(delta)}"}}
    window_min = int(parse_duration(settings["window"], "window") // 60)
    for_min = int(parse_duration(settings["for"], "for") // 60)
    run_promtool(tmp_path, rule_object["spec"]["groups"], [{
        "interval": "1m", "input_series": latency_series(),
        "alert_rule_test": [
            # rate() answers from the second sample (1m): pending while `for` runs, then firing for
            # llm/slow alone, and still when the window is full
            {"eval_time": f"{for_min}m", "alertname": ALERT_NAME, "exp_alerts": []},
            {"eval_time": f"{for_min + 2}m", "alertname": ALERT_NAME, "exp_alerts": [fired]},
            {"eval_time": f"{window_min + for_min + 2}m", "alertname": ALERT_NAME, "exp_alerts": [fired]},
        ]}])


def test_the_operators_own_rule_passes_promtool_and_keeps_its_labels(tmp_path):
    analysis = AnalysisSpec(prometheus_url="http://prometheus:9090", max_delta_ms=50)
    rule_object = build_prometheus_rule(Owner("slow", "llm", "uid"), analysis)
    fired = {"exp_labels": {"severity": "warning", "namespace": "llm", "sitsdeployment": "slow"},
             "exp_annotations": {"summary": "Canary P95 latency of llm/slow exceeds stable by more than 50 ms",
                                 "description": f"canary minus stable: {humanize_ms(expected_delta_s(0.95))}"}}
    run_promtool(tmp_path, rule_object["spec"]["groups"], [{
        "interval": "1m", "input_series": latency_series(),
        "alert_rule_test": [{"eval_time": "7m", "alertname": ALERT_NAME, "exp_alerts": [fired]}]}])
