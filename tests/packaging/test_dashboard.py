"""The Grafana dashboard has the panels operators need, and every metric it or the alert rule names is exported.

Exported means: in the /metrics of a real `sits serve --tenants examples/tenants.yaml` process (a
tiny random Llama on CPU, after a few requests so histograms have samples); the tenancy series come
from the tenancy layer's collector, which the server registers. A metric that nothing exports yet
fails its own parametrized case, named after the metric.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.packaging.chart import CHART_DIR, ROOT, objects, one
from tests.support.services import free_port, started

DASHBOARD = json.loads((CHART_DIR / "dashboards" / "sits.json").read_text())
METRIC_NAME = re.compile(r"\bsits_[a-z0-9_]+\b")
API_KEY = {"Authorization": "Bearer sk-finance-example"}  # the finance tenant of examples/tenants.yaml
FILTERS = 'namespace=~"$namespace",sitsdeployment=~"$sitsdeployment"'


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


@pytest.fixture(scope="module")
def exported_metrics(tiny_llama_dir: Path) -> set[str]:
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--port", str(port), "--num-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4",
            "--tenants", str(ROOT / "examples" / "tenants.yaml"), "--log-level", "warning"]
    with started(argv, port, timeout_s=120, log_name="serve.log") as service:
        deadline = time.monotonic() + 60
        while httpx.get(f"{service.url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "sits serve never became ready"
            time.sleep(0.1)
        for body in ({"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True},
                     {"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True, "stream": True}):
            answer = httpx.post(f"{service.url}/v1/completions", json=body, headers=API_KEY, timeout=60)
            assert answer.status_code == 200, answer.text
        return sample_names(httpx.get(f"{service.url}/metrics", timeout=10).text)


@pytest.mark.parametrize("metric", NAMED_METRICS)
def test_a_metric_the_dashboard_or_the_rule_names_is_exported(metric, exported_metrics):
    assert metric in exported_metrics, (
        f"{metric} is named by the dashboard or the alert rule, but `sits serve` does not export it")


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
