"""End to end: real runtimes, real Prometheus and Alertmanager, the operator deciding.

The operator runs against KMock; `LocalKubelet` runs a real `sits serve` per track from the
Deployments it writes (a tiny random Llama on CPU), `WeightedGateway` splits a steady load by the
HTTPRoute's weights, and Prometheus scrapes both runtimes with the target labels a ServiceMonitor
would add. The canary's template differs in its engine configuration (float16 weights on CPU,
one sequence at a time), which makes it slower:

1. the operator's Prometheus analysis rolls it back within two analysis intervals of the moment
   Prometheus first shows the P95 delta over maxDeltaMs;
2. with analysis off, the operator's own SitsCanaryP95Delta rule fires in Prometheus, Alertmanager
   posts it to the operator's webhook, and that rolls the next canary back.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from sits.operator.analysis import PrometheusProvider
from sits.operator.meta import API_VERSION, KIND, Owner
from sits.operator.monitoring import ALERT_NAME, alert_rule
from sits.operator.queries import delta_expr
from sits.operator.spec_rollout import AnalysisSpec
from sits.operator.status import from_timestamp
from tests.operator.helpers import condition, deployment, sitsdeployment, wait_for, wait_for_status
from tests.operator.local_pods import LocalKubelet, WeightedGateway
from tests.support.services import alertmanager_server, prometheus_server

pytestmark = pytest.mark.slow

NAME, NAMESPACE, MODEL = "e2e", "llm", "tiny-llama"
INTERVAL_S, WINDOW_S, MAX_DELTA_MS = 4.0, 10.0, 100.0
OWNER = Owner(NAME, NAMESPACE, "")
RULE_ANALYSIS = AnalysisSpec(prometheus_url="", max_delta_ms=MAX_DELTA_MS, interval_s=1.0, window_s=WINDOW_S)


def prometheus_config(kubelet: LocalKubelet, alertmanager_port: int) -> str:
    targets = [kubelet.metrics_target("stable"), kubelet.metrics_target("canary")]
    return yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]},
        "scrape_configs": [{"job_name": "sits", "static_configs": [
            {"targets": targets, "labels": {"namespace": NAMESPACE, "sitsdeployment": NAME}}]}],
    })


def alertmanager_config(webhook_port: int, token_file: Path) -> str:
    """Route every alert to the operator's webhook, with its bearer token read from a file (as the chart's NOTES show)."""
    return yaml.safe_dump({
        "route": {"receiver": "sits-operator", "group_by": ["alertname", "namespace", "sitsdeployment"],
                  "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "sits-operator", "webhook_configs": [{
            "url": f"http://127.0.0.1:{webhook_port}/alertmanager",
            "http_config": {"authorization": {"type": "Bearer", "credentials_file": str(token_file)}}}]}],
    })


def firing(prometheus_url: str) -> list[dict]:
    with urllib.request.urlopen(f"{prometheus_url}/api/v1/alerts", timeout=5) as response:
        return [a for a in json.loads(response.read())["data"]["alerts"] if a["state"] != "inactive"]


class BreachWatch:
    """Polls the P95-delta query; `first_breach` is when Prometheus first showed it above maxDeltaMs."""

    def __init__(self, prometheus_url: str) -> None:
        self.provider = PrometheusProvider(prometheus_url)
        self.first_breach: float | None = None
        self.last_value: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="breach-watch", daemon=True)

    def _run(self) -> None:
        query = delta_expr(NAMESPACE, NAME, 0.95, WINDOW_S)
        while not self._stop.wait(0.25):
            self.last_value = self.provider.run(query, 2.0).value
            if self.first_breach is None and self.last_value is not None and self.last_value * 1000 > MAX_DELTA_MS:
                self.first_breach = time.time()

    def __enter__(self) -> BreachWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_slow_canary_is_rolled_back_by_analysis_and_by_the_alert(
        kube, deployments, run_operator, operator_config, tiny_llama_dir, tmp_path):
    kubelet = LocalKubelet(kube, deployments, NAMESPACE, NAME)
    token_file = tmp_path / "webhook-token"
    token_file.write_text(operator_config.webhook_token)
    with kubelet, alertmanager_server(alertmanager_config(operator_config.webhook_port, token_file)) as alertmanager, \
            prometheus_server(prometheus_config(kubelet, alertmanager.port), "groups: []\n") as prometheus, \
            run_operator():
        analysis = {"prometheus": {"url": prometheus.url}, "maxDeltaMs": MAX_DELTA_MS, "interval": f"{INTERVAL_S:g}s",
                    "window": f"{WINDOW_S:g}s", "failureLimit": 2, "inconclusiveLimit": 30}
        kube.create(sitsdeployment(
            NAME, NAMESPACE, replicas=1, gpusPerReplica=0,
            model={"name": MODEL, "uri": f"file://{tiny_llama_dir}"},
            rollout={"canary": {"steps": [{"setWeight": 80}, {"pause": {}}], "analysis": analysis},
                     "trafficRouting": {"gatewayAPI": {"httpRoute": NAME}}}))
        stable = wait_for_status(kube, NAME, lambda s: s.get("phase") == "Healthy", timeout_s=120,
                                 what="the stable runtime serving")["stableRevision"]
        with WeightedGateway(kube, NAMESPACE, NAME, kubelet, MODEL, workers=6) as gateway, \
                BreachWatch(prometheus.url) as watch:
            # 1. A slower engine configuration is a new template: a canary, measured by the analysis
            kube.patch(API_VERSION, KIND, NAMESPACE, NAME,
                       {"spec": {"model": {"dtype": "float16"}, "engine": {"maxNumSeqs": 1, "maxNumBatchedTokens": 8}}})
            status = wait_for_status(kube, NAME, lambda s: s.get("phase") == "RolledBack", timeout_s=120,
                                     what=f"the analysis rollback\n{kubelet.log_tail()}")
            rolled_back = condition(status, "RolledBack")
            assert rolled_back["reason"] == "AnalysisFailed" and status["analysis"]["lastDeltaMs"] > MAX_DELTA_MS
            assert watch.first_breach is not None, "Prometheus never showed the breach"
            took = from_timestamp(rolled_back["lastTransitionTime"]) - watch.first_breach
            assert took <= 2 * INTERVAL_S + operator_config.resync_interval_s + 1.0, took
            assert status["stableRevision"] == stable and status["canaryWeight"] == 0
            assert deployment(kube, NAME, "canary")["spec"]["replicas"] == 0
            assert gateway.sent["canary"] > 0
            wait_for(lambda: gateway.canary_weight == 0, what="the gateway to see weight 0")

            # 2. The alert rule goes live (Prometheus needs a few seconds to route alerts after a reload);
            # it may fire on the rolled-back canary's last samples, which the webhook ignores
            rules = {"groups": [{"name": "sits", "rules": [alert_rule(OWNER, RULE_ANALYSIS)]}]}
            (prometheus.workdir / "rules.yml").write_text(yaml.safe_dump(rules))
            urllib.request.urlopen(urllib.request.Request(f"{prometheus.url}/-/reload", method="POST"), timeout=10)
            wait_for(lambda: watch.last_value is None and not firing(prometheus.url), timeout_s=3 * WINDOW_S,
                     interval_s=0.25, what="the rolled-back canary's samples to leave the window")
            # Analysis off; a new template (an env var) keeps the slow engine flags: the alert must do it
            kube.patch(API_VERSION, KIND, NAMESPACE, NAME,
                       {"spec": {"rollout": {"canary": {"analysis": None}}, "nccl": {"env": {"NCCL_DEBUG": "WARN"}}}})
            canary = wait_for_status(kube, NAME, lambda s: s.get("phase") == "Paused", timeout_s=60,
                                     what="the second canary at 80 %")["canaryRevision"]
            status = wait_for_status(kube, NAME, lambda s: s.get("phase") == "RolledBack", timeout_s=90,
                                     what=f"the alert rollback\n{kubelet.log_tail()}")
            rolled_back = condition(status, "RolledBack")
            assert rolled_back["reason"] == "AlertFiring" and ALERT_NAME in rolled_back["message"]
            assert status["abortedRevision"] == canary and status["stableRevision"] == stable
