"""Prometheus stopped in the middle of a canary, then started again: the rollout holds, then resumes.

The operator runs against KMock with a real Prometheus scraping latency sources whose canary is as
fast as stable. Mid-canary (paused at step 2 of 3, weight 25) Prometheus is stopped: analysis
becomes inconclusive, which must pause the rollout (never promote blind, never roll back) and
keep both Deployments as they are. With Prometheus back on the same port and storage, resuming
finishes the rollout, and the operator never made a second copy of any object.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sits.operator.analysis import PrometheusProvider, run_analysis
from sits.operator.meta import API_VERSION, KIND, Owner
from sits.operator.spec_rollout import AnalysisSpec
from tests.operator.conftest import cluster, deployments, kube, operator_config, run_operator  # noqa: F401
from tests.operator.helpers import (
    condition,
    events,
    set_image,
    sitsdeployment,
    status_of,
    wait_for,
    wait_for_status,
)
from tests.operator.latency_source import LatencySource, scrape_config, serving
from tests.support.services import RunningService, free_port, require_binary, started

ANALYSIS = {"maxDeltaMs": 50, "interval": "1s", "window": "20s", "failureLimit": 2, "inconclusiveLimit": 2,
            "timeout": "1s"}
NAME = "outage"


@contextmanager
def prometheus_at(port: int, workdir: Path) -> Iterator[RunningService]:
    """A real Prometheus on a given port and storage directory, so a restart keeps both."""
    argv = [require_binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
    with started(argv, port, workdir=workdir, log_name="prometheus.log") as service:
        yield service


def wait_for_samples(url: str) -> None:
    provider, spec = PrometheusProvider(url), AnalysisSpec(prometheus_url=url, max_delta_ms=50, window_s=20)
    wait_for(lambda: run_analysis(provider, Owner(NAME, "llm", ""), spec).delta_ms is not None,
             timeout_s=30, interval_s=0.25, what="two scrapes of stable and canary")


def objects(kube) -> list[tuple[str, str]]:  # noqa: F811 - kube here is the client, not the fixture
    found = []
    for api_version, kind in (("v1", "ConfigMap"), ("apps/v1", "Deployment"), ("v1", "Service"),
                              ("gateway.networking.k8s.io/v1", "HTTPRoute")):
        found += [(kind, o["metadata"]["name"]) for o in kube.list(api_version, kind, "llm")]
    return sorted(found)


def resume(kube) -> None:  # noqa: F811
    kube.patch(API_VERSION, KIND, "llm", NAME, {"metadata": {"annotations": {"sits.ai/resume": "true"}}})
    wait_for(lambda: "sits.ai/resume" not in (kube.get(API_VERSION, KIND, "llm", NAME)["metadata"].get("annotations")
                                              or {}), what="the resume annotation consumed")


def test_prometheus_stopped_mid_canary_pauses_it_and_the_rollout_finishes_once_it_returns(
        kube, deployments, run_operator, tmp_path):  # noqa: F811
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sources = [LatencySource("stable", 0.020), LatencySource("canary", 0.021)]
    (tmp_path / "prometheus.yml").write_text(scrape_config({("llm", NAME): sources}))
    rollout = {"canary": {"steps": [{"setWeight": 25}, {"pause": {}}, {"setWeight": 50}],
                          "analysis": {"prometheus": {"url": url}, **ANALYSIS}},
               "trafficRouting": {"gatewayAPI": {"httpRoute": "llm-route"}}}
    with serving(*sources), run_operator():
        with prometheus_at(port, tmp_path):
            wait_for_samples(url)
            kube.create(sitsdeployment(NAME, rollout=rollout))
            stable = wait_for_status(kube, NAME, lambda s: s.get("phase") == "Healthy", what="Healthy")["stableRevision"]
            set_image(kube, NAME, "registry.example.com/sits:2")
            held = wait_for_status(kube, NAME, lambda s: s.get("currentStep") == 1 and s.get("phase") == "Paused",
                                   timeout_s=20, what="the canary paused at step 2 after a passing analysis")
            assert held["canaryWeight"] == 25 and held["analysis"]["lastResult"] == "Passed"
            canary, before = held["canaryRevision"], objects(kube)
        # Prometheus is gone, mid-canary.
        status = wait_for_status(kube, NAME, lambda s: (condition(s, "Paused") or {}).get("reason")
                                 == "AnalysisInconclusive", timeout_s=20, what="an inconclusive pause")
        time.sleep(2)  # more inconclusive runs: still held, never rolled back nor promoted
        status = status_of(kube, NAME)
        assert status["phase"] == "Paused" and "abortedRevision" not in status
        assert (status["stableRevision"], status["canaryRevision"], status["canaryWeight"]) == (stable, canary, 25)
        assert status["analysis"]["consecutiveFailures"] == 0 and status["analysis"]["consecutiveInconclusive"] >= 2
        assert "unreachable" in condition(status, "Paused")["message"]
        assert objects(kube) == before
        with prometheus_at(port, tmp_path):
            wait_for_samples(url)
            resume(kube)  # out of the inconclusive pause, back to the step's own pause
            wait_for_status(kube, NAME, lambda s: (condition(s, "Paused") or {}).get("reason") == "CanaryPauseStep",
                            what="back in the step's pause")
            resume(kube)  # past the pause: weight 50 after a passing analysis, then promotion
            final = wait_for_status(kube, NAME, lambda s: s.get("phase") == "Healthy", timeout_s=30, what="promoted")
    assert final["stableRevision"] == canary and "abortedRevision" not in final
    reasons = [e["reason"] for e in events(kube, NAME)]
    assert reasons.count("CanaryStarted") == 1 and "RolledBack" not in reasons
    assert objects(kube) == before
