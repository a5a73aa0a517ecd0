"""The operator's Prometheus metrics: read from what the reconciles decided, served on the health port.

The unit tests feed `RolloutStats` statuses as the reconciler writes them; the live test follows a
SitsDeployment through a whole rollout on a running operator (KopfRunner against KMock) and
scrapes its /metrics at each step, comparing with the status the operator wrote.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request

import kubernetes.client
import pytest
from prometheus_client import generate_latest

from sits.operator.kube import ApiError, KubeClient
from sits.operator.meta import API_VERSION, KIND
from sits.operator.metrics import build_registry
from sits.operator.reconciler import Reconciler
from sits.operator.stats import RolloutStats
from sits.operator.status import PHASES, AnalysisState, Status
from tests.operator.helpers import (
    Samples,
    firing,
    parse_metrics,
    post_alerts,
    sample,
    scrape,
    set_image,
    sitsdeployment,
    status_of,
    wait_for,
)
from tests.support.services import free_port, wait_for_port


def rollout_series(samples: Samples) -> set[tuple[str, frozenset]]:
    return {key for key in samples if key[0].startswith("sits_rollout_")}


def exported(stats: RolloutStats) -> Samples:
    return parse_metrics(generate_latest(build_registry(stats.snapshot)).decode())


def rolled_back(reason: str) -> Status:
    status = Status(phase="RolledBack", aborted_revision="b")
    status.set_condition("RolledBack", True, reason, "canary b rolled back", 0.0)
    return status


def test_the_phase_is_one_for_the_current_phase_and_zero_for_the_others():
    stats = RolloutStats()
    stats.record("llm", "a", Status(phase="Paused", canary_weight=25,
                                    analysis=AnalysisState(last_delta_ms=12.5)))
    stats.record("other", "a", Status(phase="Healthy"))
    samples = exported(stats)
    for namespace, current in (("llm", "Paused"), ("other", "Healthy")):
        phases = {phase: sample(samples, "sits_rollout_phase", namespace=namespace, sitsdeployment="a", phase=phase)
                  for phase in PHASES}
        assert phases == {phase: float(phase == current) for phase in PHASES}
    assert sample(samples, "sits_rollout_canary_weight", namespace="llm", sitsdeployment="a") == 25
    assert sample(samples, "sits_rollout_analysis_delta_ms", namespace="llm", sitsdeployment="a") == 12.5
    # never measured: no series, rather than a 0 that reads as "canary exactly as fast"
    assert sample(samples, "sits_rollout_analysis_delta_ms", namespace="other", sitsdeployment="a") is None
    assert sample(samples, "sits_operator_reconcile_errors_total") == 0


def test_aborts_count_by_reason_and_promotions_count_promoted_events():
    stats = RolloutStats()
    stats.record("llm", "a", Status(phase="Healthy"))
    resource = {"namespace": "llm", "sitsdeployment": "a"}
    samples = exported(stats)  # every reason at 0 from the start, so rate() sees the first abort
    assert [sample(samples, "sits_rollout_aborts_total", **resource, reason=r) for r in ("analysis", "alert")] == [0, 0]
    assert sample(samples, "sits_rollout_promotions_total", **resource) == 0
    stats.record("llm", "a", rolled_back("AnalysisFailed"), ["RolledBack"])
    stats.record("llm", "a", rolled_back("AnalysisFailed"))  # later reconciles of the same abort post no Event
    stats.record("llm", "a", rolled_back("AlertFiring"), ["CanaryStarted", "RolledBack"])
    stats.record("llm", "a", Status(phase="Healthy"), ["CanaryStarted", "Promoted"])
    samples = exported(stats)
    assert sample(samples, "sits_rollout_aborts_total", **resource, reason="analysis") == 1
    assert sample(samples, "sits_rollout_aborts_total", **resource, reason="alert") == 1
    assert sample(samples, "sits_rollout_promotions_total", **resource) == 1


def test_a_forgotten_sitsdeployment_leaves_no_series():
    stats = RolloutStats()
    stats.record("llm", "gone", Status(phase="Healthy"), ["Promoted"])
    stats.record("llm", "kept", Status(phase="Healthy"))
    stats.forget("llm", "gone")
    names = {dict(labels).get("sitsdeployment") for _, labels in rollout_series(exported(stats))}
    assert names == {"kept"}


def test_a_reconcile_the_api_server_fails_is_counted_as_an_error():
    configuration = kubernetes.client.Configuration(host=f"http://127.0.0.1:{free_port()}")  # nothing listens
    reconciler = Reconciler(KubeClient(kubernetes.client.ApiClient(configuration), timeout_s=2))
    try:
        for _ in range(2):
            with pytest.raises(ApiError):
                reconciler.reconcile("llm", "unreachable")
    finally:
        reconciler.kube.close()
    samples = parse_metrics(generate_latest(build_registry(reconciler.stats.snapshot)).decode())
    assert sample(samples, "sits_operator_reconcile_errors_total") == 2
    assert rollout_series(samples) == set()


def test_the_metrics_follow_a_rollout_on_the_operators_health_port(kube, deployments, run_operator, operator_config):
    config = dataclasses.replace(operator_config, health_port=free_port())
    resource = {"namespace": "llm", "sitsdeployment": "watched"}

    def metrics_show(phase: str, weight: int, promotions: int, alert_aborts: int = 0) -> bool:
        """The scrape says what the status says, and the status is what this step expects."""
        samples, status = scrape(config.health_port), status_of(kube, "watched")
        return (status.get("phase") == phase and status.get("canaryWeight") == weight
                and sample(samples, "sits_rollout_phase", **resource, phase=phase) == 1
                and sum(sample(samples, "sits_rollout_phase", **resource, phase=p) for p in PHASES) == 1
                and sample(samples, "sits_rollout_canary_weight", **resource) == weight
                and sample(samples, "sits_rollout_promotions_total", **resource) == promotions
                and sample(samples, "sits_rollout_aborts_total", **resource, reason="alert") == alert_aborts
                and sample(samples, "sits_rollout_aborts_total", **resource, reason="analysis") == 0)

    with run_operator(config):
        wait_for_port(config.health_port)  # the health server starts with the operator's startup handler
        with urllib.request.urlopen(f"http://127.0.0.1:{config.health_port}/healthz", timeout=5) as response:
            assert (response.status, json.loads(response.read())) == (200, {"status": "ok"})
        kube.create(sitsdeployment("watched", rollout={"canary": {"steps": [{"setWeight": 50}, {"pause": {}}]}}))
        wait_for(lambda: metrics_show("Healthy", weight=0, promotions=0), what="Healthy")
        set_image(kube, "watched", "registry.example.com/sits:2")
        wait_for(lambda: metrics_show("Paused", weight=50, promotions=0), what="a canary paused at 50 %")
        kube.patch(API_VERSION, KIND, "llm", "watched", {"metadata": {"annotations": {"sits.ai/resume": "true"}}})
        wait_for(lambda: metrics_show("Healthy", weight=0, promotions=1), what="one promotion")
        set_image(kube, "watched", "registry.example.com/sits:3")
        wait_for(lambda: metrics_show("Paused", weight=50, promotions=1), what="the next canary paused")
        code, answer = post_alerts(config.webhook_port, {"status": "firing", "alerts": [firing("llm", "watched")]})
        assert (code, answer) == (200, {"status": "received"})
        wait_for(lambda: metrics_show("RolledBack", weight=0, promotions=1, alert_aborts=1), what="one abort by an alert")
        samples = scrape(config.health_port)
        assert sample(samples, "sits_rollout_analysis_delta_ms", **resource) is None  # no analysis configured
        assert sample(samples, "sits_operator_reconcile_errors_total") == 0
        kube.delete(API_VERSION, KIND, "llm", "watched")
        wait_for(lambda: not rollout_series(scrape(config.health_port)), what="the deleted resource's series gone")
        time.sleep(0.5)  # a resync that was already running must not bring them back
        assert not rollout_series(scrape(config.health_port))
