"""The Grafana dashboard has the panels operators need, and every metric it or the alert rule names is exported.

Exported means: in the /metrics of the live process that exports it. Serving metrics come from a
real `sits serve --tenants examples/tenants.yaml` (a tiny random Llama on CPU, after a few requests
so histograms have samples; the tenancy series from the collector the server registers). Rollout
metrics (`sits_rollout_*`, `sits_operator_*`) come from a real `python -m sits.operator` reconciling
a SitsDeployment in the emulated API server (KMock). A metric that nothing exports fails its own
parametrized case, named after the metric.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import httpx
import kubernetes.config
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sits.operator.kube import KubeClient
from tests.operator.deployment_controller import DeploymentController
from tests.operator.helpers import sitsdeployment, wait_for, wait_for_status
from tests.operator.kmock_cluster import kmock_cluster
from tests.packaging.chart import CHART_DIR, ROOT, objects, one
from tests.support.services import free_port, started

DASHBOARD = json.loads((CHART_DIR / "dashboards" / "sits.json").read_text())
METRIC_NAME = re.compile(r"\bsits_[a-z0-9_]+\b")
API_KEY = {"Authorization": "Bearer sk-finance-example"}  # the finance tenant of examples/tenants.yaml
FILTERS = 'namespace=~"$namespace",sitsdeployment=~"$sitsdeployment"'
OPERATOR_PREFIXES = ("sits_rollout_", "sits_operator_")  # what the operator exports; the rest, sits serve


def panels() -> list[dict]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def dashboard_queries() -> list[str]:
    queries = [target["expr"] for panel in panels() for target in panel.get("targets", [])]
    queries += [v["query"]["query"] for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]
    return queries


def rule_queries() -> list[str]:
    rule_object = one(objects({"prometheusRule": {"enabled": True}}), "PrometheusRule")
    return [rule["expr"] for group in rule_object["spec"]["groups"] for rule in group["rules"]]


NAMED_METRICS = sorted({name for query in dashboard_queries() + rule_queries() for name in METRIC_NAME.findall(query)})


def sample_names(exposition: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}


def exported_by_the_operator(metric: str) -> bool:
    return metric.startswith(OPERATOR_PREFIXES)


@pytest.fixture(scope="module")
def runtime_metrics(tiny_llama_dir: Path) -> set[str]:
    port, metrics_port = free_port(), free_port()  # with tenants, /metrics is on its own port
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--port", str(port), "--num-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4",
            "--tenants", str(ROOT / "examples" / "tenants.yaml"), "--log-level", "warning",
            "--metrics-port", str(metrics_port)]
    with started(argv, port, timeout_s=120, log_name="serve.log") as service:
        deadline = time.monotonic() + 60
        while httpx.get(f"{service.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "sits serve never became ready"
            time.sleep(0.1)
        for body in ({"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True},
                     {"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True, "stream": True}):
            answer = httpx.post(f"{service.url}/v1/completions", json=body, headers=API_KEY, timeout=60)
            assert answer.status_code == 200, answer.text
        return sample_names(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text)


@pytest.fixture(scope="module")
def operator_exposition(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The /metrics of `python -m sits.operator` once a SitsDeployment `llama` is Healthy."""
    with kmock_cluster(tmp_path_factory.mktemp("kmock")) as cluster:
        kube = KubeClient(kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig),
                                                                   persist_config=False), timeout_s=10)
        health = free_port()
        argv = [sys.executable, "-m", "sits.operator", "--listen-host", "127.0.0.1", "--health-port", str(health),
                "--webhook-port", "0", "--resync-interval", "0.3"]
        try:
            with DeploymentController(kube), started(argv, health, env={"KUBECONFIG": str(cluster.kubeconfig)},
                                                     timeout_s=60, log_name="operator.log") as operator:
                kube.create(sitsdeployment("llama"))
                wait_for_status(kube, "llama", lambda s: s.get("phase") == "Healthy", timeout_s=30, what="Healthy")

                def scraped() -> str | None:
                    text = httpx.get(f"{operator.url}/metrics", timeout=10).text
                    return text if 'phase="Healthy",sitsdeployment="llama"} 1.0' in text else None
                return wait_for(scraped, what="the operator's metrics to show the resource")
        finally:
            kube.close()


@pytest.mark.parametrize("metric", NAMED_METRICS)
def test_a_metric_the_dashboard_or_the_rule_names_is_exported(metric, request):
    if exported_by_the_operator(metric):
        exporter, exported = "the operator", sample_names(request.getfixturevalue("operator_exposition"))
    else:
        exporter, exported = "`sits serve`", request.getfixturevalue("runtime_metrics")
    assert metric in exported, f"{metric} is named by the dashboard or the alert rule, but {exporter} does not export it"


def test_the_rollout_phase_panel_groups_by_labels_the_operator_exports(operator_exposition):
    (target,) = next(p for p in panels() if p["title"] == "Rollout phase")["targets"]
    grouping = re.search(r"max by \(([^)]*)\) \(sits_rollout_phase\{", target["expr"])
    assert grouping, target["expr"]
    (family,) = [f for f in text_string_to_metric_families(operator_exposition) if f.name == "sits_rollout_phase"]
    grouped_by = {label.strip() for label in grouping.group(1).split(",")}
    assert grouped_by == {"namespace", "sitsdeployment", "phase"}
    assert family.samples and all(set(sample.labels) == grouped_by for sample in family.samples)
    # `== 1` keeps one series per SitsDeployment: its current phase
    current = [(s.labels["namespace"], s.labels["phase"]) for s in family.samples if s.value == 1]
    assert current == [("llm", "Healthy")] and target["expr"].endswith("== 1")


def test_the_dashboard_has_the_panels_operators_need():
    titles = " | ".join(p["title"] for p in panels())
    for needed in ("Rollout phase", "P95 latency delta, canary − stable", "Request latency P50 / P95 / P99",
                   "Time to first token", "Inter-token latency", "tokens/s", "KV-cache blocks per tenant",
                   "KV-cache evictions per tenant", "Rate-limited requests per tenant"):
        assert needed in titles, needed
    latency = next(p for p in panels() if p["title"].startswith("Request latency"))
    assert [t["legendFormat"] for t in latency["targets"]] == ["P50 {{track}}", "P95 {{track}}", "P99 {{track}}"]
    assert all("sum by (track, le)" in t["expr"] for t in latency["targets"])
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in DASHBOARD["templating"]["list"]} == {"datasource", "namespace", "sitsdeployment",
                                                                      "tenant"}
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels() for t in p["targets"])


def test_the_delta_panel_asks_what_the_alert_rule_asks():
    (delta,) = next(p for p in panels() if p["title"].startswith("P95 latency delta"))["targets"]
    (rule,) = rule_queries()
    every_resource = delta["expr"].replace(FILTERS, 'sitsdeployment!=""')
    assert rule == f"({every_resource}) > 0.05"
