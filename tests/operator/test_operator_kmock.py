"""The operator end to end against KMock (kopf.testing.KopfRunner), with a real Prometheus for analysis.

KMock runs no pods: `deployments` (a DeploymentController) marks Deployments ready, as
kube-controller-manager would once their pods pass readiness. Prometheus scrapes latency
histograms whose canary is as fast as stable (`promote`) or 200 ms slower (`slow`).
"""

from __future__ import annotations

import dataclasses
import time
import urllib.error
import urllib.request

import pytest

from sits.operator.analysis import PrometheusProvider, run_analysis
from sits.operator.meta import API_VERSION, KIND, Owner
from sits.operator.spec_rollout import AnalysisSpec
from sits.operator.webhook import MESSAGE_LIMIT
from tests.operator.helpers import (
    WEBHOOK_TOKEN,
    condition,
    deployment,
    events,
    firing,
    post_alerts,
    sample,
    scrape_when,
    set_image,
    sitsdeployment,
    status_of,
    wait_for,
    wait_for_status,
)
from tests.operator.latency_source import LatencySource, scrape_config, serving
from tests.support.services import free_port, prometheus_server

ANALYSIS = {"maxDeltaMs": 50, "interval": "1s", "window": "20s", "failureLimit": 2, "inconclusiveLimit": 2,
            "timeout": "2s"}
GATEWAY = {"gatewayAPI": {"httpRoute": "llm-route"}}
ROUTE_API = "gateway.networking.k8s.io/v1"


@pytest.fixture(scope="module")
def prometheus():
    sources = {("llm", "promote"): [LatencySource("stable", 0.020), LatencySource("canary", 0.021)],
               ("llm", "slow"): [LatencySource("stable", 0.020), LatencySource("canary", 0.200)]}
    with serving(*[s for group in sources.values() for s in group]), \
            prometheus_server(scrape_config(sources)) as service:
        provider = PrometheusProvider(service.url)
        spec = AnalysisSpec(prometheus_url=service.url, max_delta_ms=50, window_s=20)
        for name in ("promote", "slow"):  # rate() needs two scrapes of each target
            wait_for(lambda name=name: run_analysis(provider, Owner(name, "llm", ""), spec).delta_ms is not None,
                     timeout_s=20, interval_s=0.25, what=f"samples of {name}")
        yield service


def rollout(prometheus_url: str, steps: list, **analysis) -> dict:
    return {"canary": {"steps": steps, "analysis": {"prometheus": {"url": prometheus_url}, **ANALYSIS, **analysis}},
            "trafficRouting": GATEWAY}


def route_weights(kube) -> list[tuple[str, int]]:
    route = kube.get(ROUTE_API, "HTTPRoute", "llm", "llm-route")
    return [(b["name"], b["weight"]) for b in route["spec"]["rules"][-1]["backendRefs"]] if route else []


def image_of(kube, name: str, track: str) -> str:
    return deployment(kube, name, track)["spec"]["template"]["spec"]["containers"][0]["image"]


def reasons(kube, name: str) -> list[str]:
    return [e["reason"] for e in events(kube, name)]


def owned_objects(kube) -> dict[tuple[str, str], str]:
    """(kind, name) -> resourceVersion of everything the operator may have written in the namespace."""
    found = {}
    for api_version, kind in (("v1", "ConfigMap"), ("apps/v1", "Deployment"), ("v1", "Service"),
                              ("policy/v1", "PodDisruptionBudget"), (ROUTE_API, "HTTPRoute")):
        for obj in kube.list(api_version, kind, "llm"):
            found[(kind, obj["metadata"]["name"])] = (obj["metadata"]["resourceVersion"],
                                                      obj["metadata"]["ownerReferences"][0]["uid"])
    return found


def test_create_makes_the_workloads_and_reconciling_again_writes_nothing(kube, deployments, run_operator):
    with run_operator():
        kube.create(sitsdeployment("demo", rollout={"trafficRouting": GATEWAY}))
        status = wait_for_status(kube, "demo", lambda s: s.get("phase") == "Healthy", what="Healthy")
        assert status["ready"] == "2/2" and status["canaryWeight"] == 0 and "canaryRevision" not in status
        assert status["stableRevision"] == deployment(kube, "demo", "stable")["metadata"]["annotations"]["sits.ai/revision"]
        assert deployment(kube, "demo", "stable")["spec"]["replicas"] == 2
        assert deployment(kube, "demo", "canary")["spec"]["replicas"] == 0
        assert route_weights(kube) == [("demo-stable", 100), ("demo-canary", 0)]
        uid = kube.get(API_VERSION, KIND, "llm", "demo")["metadata"]["uid"]
        before = owned_objects(kube)
        assert len(before) == 8 and {owner for _, owner in before.values()} == {uid}
        version = kube.get(API_VERSION, KIND, "llm", "demo")["metadata"]["resourceVersion"]
        time.sleep(1.5)  # five more reconciles
        assert owned_objects(kube) == before, "a reconcile run again must create or change nothing"
        assert kube.get(API_VERSION, KIND, "llm", "demo")["metadata"]["resourceVersion"] == version
        kube.patch(API_VERSION, KIND, "llm", "demo", {"spec": {"replicas": 3}})
        wait_for_status(kube, "demo", lambda s: s.get("ready") == "3/3" and s.get("phase") == "Healthy",
                        what="scaled in place")
        assert "canaryRevision" not in status_of(kube, "demo")


def test_template_change_runs_a_canary_and_promotes(kube, deployments, run_operator, prometheus):
    steps = [{"setWeight": 50}, {"pause": {"duration": "1s"}}]
    with run_operator():
        kube.create(sitsdeployment("promote", replicas=2, rollout=rollout(prometheus.url, steps)))
        first = wait_for_status(kube, "promote", lambda s: s.get("phase") == "Healthy", what="Healthy")
        set_image(kube, "promote", "registry.example.com/sits:2")
        status = wait_for_status(kube, "promote", lambda s: s.get("canaryRevision"), what="a canary")
        assert status["stableRevision"] == first["stableRevision"] != status["canaryRevision"]
        wait_for(lambda: route_weights(kube) == [("promote-stable", 50), ("promote-canary", 50)],
                 what="half the traffic on the canary")
        assert image_of(kube, "promote", "canary").endswith(":2") and image_of(kube, "promote", "stable").endswith(":1")
        assert deployment(kube, "promote", "canary")["spec"]["replicas"] == 1
        final = wait_for_status(kube, "promote", lambda s: s.get("phase") == "Healthy"
                                and s.get("stableRevision") == status["canaryRevision"], timeout_s=30, what="promoted")
        assert final["analysis"]["lastResult"] == "Passed" and abs(final["analysis"]["lastDeltaMs"]) < 50
        assert image_of(kube, "promote", "stable").endswith(":2")
        assert deployment(kube, "promote", "canary")["spec"]["replicas"] == 0
        assert route_weights(kube) == [("promote-stable", 100), ("promote-canary", 0)]
        # Events and metrics follow the status write: wait for them
        wait_for(lambda: {"CanaryStarted", "Promoted"} <= set(reasons(kube, "promote")), what="the rollout's Events")


def test_failing_analysis_rolls_back(kube, deployments, run_operator, operator_config, prometheus):
    config = dataclasses.replace(operator_config, health_port=free_port())
    with run_operator(config):
        kube.create(sitsdeployment("slow", rollout=rollout(prometheus.url, [{"setWeight": 25}, {"pause": {}}])))
        stable = wait_for_status(kube, "slow", lambda s: s.get("phase") == "Healthy", what="Healthy")["stableRevision"]
        set_image(kube, "slow", "registry.example.com/sits:slow")
        canary = wait_for_status(kube, "slow", lambda s: s.get("canaryRevision"), what="a canary")["canaryRevision"]
        status = wait_for_status(kube, "slow", lambda s: s.get("phase") == "RolledBack", timeout_s=20,
                                 what="RolledBack")
        assert status["stableRevision"] == stable and status["abortedRevision"] == canary
        assert status["canaryWeight"] == 0 and status["analysis"]["consecutiveFailures"] == 2
        rolled_back = condition(status, "RolledBack")
        assert rolled_back["reason"] == "AnalysisFailed" and "ms > maxDeltaMs 50 ms" in rolled_back["message"]
        assert status["analysis"]["lastDeltaMs"] > 150
        # the operator's metrics say the same: the measured delta, and one abort by the analysis (they are
        # recorded after the status is written: wait for the abort to show)
        resource = {"namespace": "llm", "sitsdeployment": "slow"}
        metrics = scrape_when(config.health_port, lambda m: sample(m, "sits_rollout_aborts_total", **resource,
                                                                   reason="analysis"), what="the abort in the metrics")
        assert sample(metrics, "sits_rollout_analysis_delta_ms", **resource) == status["analysis"]["lastDeltaMs"]
        assert sample(metrics, "sits_rollout_aborts_total", **resource, reason="analysis") == 1
        assert sample(metrics, "sits_rollout_aborts_total", **resource, reason="alert") == 0
        assert deployment(kube, "slow", "canary")["spec"]["replicas"] == 0
        assert route_weights(kube) == [("slow-stable", 100), ("slow-canary", 0)]
        warning = wait_for(lambda: [e for e in events(kube, "slow") if e["reason"] == "RolledBack"],
                           what="the RolledBack Event")
        assert warning[0]["type"] == "Warning" and "maxDeltaMs" in warning[0]["message"]
        time.sleep(1)
        assert status_of(kube, "slow")["phase"] == "RolledBack", "the same template does not start again"
        set_image(kube, "slow", "registry.example.com/sits:slow-2")
        wait_for_status(kube, "slow", lambda s: s.get("phase") == "Progressing" and s.get("canaryRevision")
                        not in (None, canary), what="a new canary after a new template")


def test_inconclusive_analysis_pauses_and_never_rolls_back(kube, deployments, run_operator):
    unreachable = f"http://127.0.0.1:{free_port()}"
    with run_operator():
        kube.create(sitsdeployment("blind", rollout=rollout(unreachable, [{"setWeight": 25}])))
        stable = wait_for_status(kube, "blind", lambda s: s.get("phase") == "Healthy", what="Healthy")["stableRevision"]
        set_image(kube, "blind", "registry.example.com/sits:2")
        status = wait_for_status(kube, "blind", lambda s: s.get("phase") == "Paused", timeout_s=20, what="Paused")
        paused = condition(status, "Paused")
        assert paused["reason"] == "AnalysisInconclusive" and "unreachable" in paused["message"]
        assert status["stableRevision"] == stable and status["canaryRevision"] and status["currentStep"] == 0
        time.sleep(2)  # more inconclusive runs: still no rollback
        status = status_of(kube, "blind")
        assert status["phase"] == "Paused" and "abortedRevision" not in status
        assert status["analysis"]["consecutiveFailures"] == 0 and status["analysis"]["consecutiveInconclusive"] >= 2
        kube.patch(API_VERSION, KIND, "llm", "blind", {"metadata": {"annotations": {"sits.ai/resume": "true"}}})
        wait_for(lambda: "Resumed" in reasons(kube, "blind"), what="a Resumed event")
        assert "sits.ai/resume" not in (kube.get(API_VERSION, KIND, "llm", "blind")["metadata"].get("annotations") or {})


def test_an_alert_through_the_webhook_rolls_back(kube, deployments, run_operator, operator_config, prometheus):
    port = operator_config.webhook_port
    received = (200, {"status": "received"})
    with run_operator():
        kube.create(sitsdeployment("alerted", rollout=rollout(prometheus.url, [{"setWeight": 25}, {"pause": {}}])))
        wait_for_status(kube, "alerted", lambda s: s.get("phase") == "Healthy", what="Healthy")
        assert post_alerts(port, {"status": "firing", "alerts": [firing("llm", "alerted")]}) == received  # no canary
        set_image(kube, "alerted", "registry.example.com/sits:2")
        canary = wait_for_status(kube, "alerted", lambda s: s.get("canaryRevision"), what="a canary")["canaryRevision"]
        assert post_alerts(port, {"alerts": "nope"})[0] == 400
        # Ignored alerts get the same answer as acted-on ones: the answer says nothing about the cluster
        assert post_alerts(port, {"status": "resolved", "alerts": [
            firing("llm", "alerted", "resolved"), {"status": "firing", "labels": {"alertname": "Other"},
                                                   "startsAt": "2026-01-01T00:00:00Z"},
            firing("other-namespace", "missing"), firing("llm", "missing"),
            firing("llm", "../../api/v1/secrets"), firing("Not A Namespace", "alerted")]}) == received
        assert status_of(kube, "alerted")["phase"] != "RolledBack"
        old = {**firing("llm", "alerted"), "startsAt": "2020-01-01T00:00:00Z"}  # fired before this canary began
        assert post_alerts(port, {"status": "firing", "alerts": [old]}) == received
        assert status_of(kube, "alerted")["phase"] != "RolledBack"
        assert post_alerts(port, {"status": "firing", "alerts": [firing("llm", "alerted")]}) == received
        status = status_of(kube, "alerted")  # aborted before the webhook answered
        assert status["phase"] == "RolledBack" and status["abortedRevision"] == canary
        assert condition(status, "RolledBack")["reason"] == "AlertFiring"
        assert "SitsCanaryP95Delta" in condition(status, "RolledBack")["message"]
        assert deployment(kube, "alerted", "canary")["spec"]["replicas"] == 0
        assert post_alerts(port, {"status": "firing", "alerts": [firing("llm", "alerted")]}) == received  # rolled back


def test_the_webhook_needs_the_bearer_token_and_startsat(kube, deployments, run_operator, operator_config):
    port = operator_config.webhook_port
    unauthorized = (401, {"error": "a valid bearer token is required"})
    with run_operator():
        kube.create(sitsdeployment("guarded", rollout={"canary": {"steps": [{"setWeight": 25}, {"pause": {}}]}}))
        wait_for_status(kube, "guarded", lambda s: s.get("phase") == "Healthy", what="Healthy")
        set_image(kube, "guarded", "registry.example.com/sits:2")
        wait_for_status(kube, "guarded", lambda s: s.get("phase") == "Paused", what="the canary paused")
        alerts = {"status": "firing", "alerts": [firing("llm", "guarded")]}
        assert post_alerts(port, alerts, token=None) == unauthorized
        assert post_alerts(port, alerts, token=WEBHOOK_TOKEN[:-1] + "X") == unauthorized
        assert post_alerts(port, alerts, token=WEBHOOK_TOKEN + "X") == unauthorized
        assert post_alerts(port, alerts, authorization=f"Basic {WEBHOOK_TOKEN}") == unauthorized
        assert post_alerts(port, alerts, authorization=WEBHOOK_TOKEN) == unauthorized
        assert post_alerts(port, b"not json", token=None) == unauthorized  # the token is checked first
        request = urllib.request.Request(f"http://127.0.0.1:{port}/alertmanager", method="POST", data=b"{}")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.headers["WWW-Authenticate"] == 'Bearer realm="sits-operator"'
        # Without startsAt nothing is acted on, not even the valid alert before it
        no_start = {key: value for key, value in firing("llm", "guarded").items() if key != "startsAt"}
        code, answer = post_alerts(port, {"status": "firing", "alerts": [firing("llm", "guarded"), no_start]})
        assert (code, answer) == (400, {"error": "alerts[1].startsAt is required: an RFC 3339 timestamp"})
        bad_start = {**firing("llm", "guarded"), "startsAt": "yesterday"}
        assert post_alerts(port, {"status": "firing", "alerts": [bad_start]})[0] == 400
        assert status_of(kube, "guarded")["phase"] == "Paused"
        # The caller's text reaches the condition and the Event bounded, printable and on one line
        hostile = firing("llm", "guarded")
        hostile["labels"]["alertname"] = "Evil\x1b[31mAlert\u202e"
        hostile["annotations"]["summary"] = "line one\r\nline two\x00\x07" + "\u200b".join("x" * 5000)
        assert post_alerts(port, {"status": "firing", "alerts": [hostile]}) == (200, {"status": "received"})
        message = condition(wait_for_status(kube, "guarded", lambda s: s.get("phase") == "RolledBack",
                                            what="RolledBack"), "RolledBack")["message"]
        assert message.isprintable()
        alert_text = message.partition(" rolled back: ")[2]  # "canary <revision> rolled back: <alert text>"
        assert alert_text.startswith("alert Evil [31mAlert firing: line one line two x x x")
        assert len(alert_text) == MESSAGE_LIMIT and alert_text.endswith("…")
        rolled_back = wait_for(lambda: [e for e in events(kube, "guarded") if e["reason"] == "RolledBack"],
                               what="the RolledBack Event")
        assert all(len(e["message"]) <= 1024 and e["message"].isprintable() for e in rolled_back)


def test_an_operator_restarted_mid_rollout_resumes_where_it_stopped(kube, deployments, run_operator, prometheus):
    with run_operator():
        kube.create(sitsdeployment("promote", rollout=rollout(prometheus.url, [{"setWeight": 50}, {"pause": {}}])))
        wait_for_status(kube, "promote", lambda s: s.get("phase") == "Healthy", what="Healthy")
        set_image(kube, "promote", "registry.example.com/sits:2")
        paused = wait_for_status(kube, "promote", lambda s: s.get("phase") == "Paused", timeout_s=20, what="Paused")
    assert paused["currentStep"] == 1 and paused["canaryWeight"] == 50
    with run_operator():
        time.sleep(1.5)  # the restarted operator reconciles a few times: same state, nothing restarted
        status = status_of(kube, "promote")
        for field in ("phase", "canaryRevision", "stableRevision", "currentStep", "canaryWeight", "canaryStartedAt"):
            assert status[field] == paused[field], field
        assert reasons(kube, "promote").count("CanaryStarted") == 1
        names = sorted(d["metadata"]["name"] for d in kube.list("apps/v1", "Deployment", "llm")
                       if d["metadata"]["name"].startswith("promote"))
        assert names == ["promote-canary", "promote-stable"]  # no duplicate workloads after the restart
        kube.patch(API_VERSION, KIND, "llm", "promote", {"metadata": {"annotations": {"sits.ai/resume": "yes"}}})
        final = wait_for_status(kube, "promote", lambda s: s.get("phase") == "Healthy", timeout_s=20, what="promoted")
        assert final["stableRevision"] == paused["canaryRevision"]


def test_an_invalid_spec_is_a_permanent_error_and_a_condition_naming_the_field(kube, deployments, run_operator):
    # Valid for the CRD's schema, which cannot say that tenant routing needs a Gateway API route
    body = sitsdeployment("broken", rollout={"canary": {"tenants": ["beta"]}})
    with run_operator():
        kube.create(body)
        status = wait_for_status(kube, "broken", lambda s: condition(s, "InvalidSpec"), what="InvalidSpec")
        invalid = condition(status, "InvalidSpec")
        assert invalid["status"] == "True" and invalid["message"].startswith("spec.rollout.canary.tenants:")
        assert status["phase"] == "Degraded" and deployment(kube, "broken", "stable") is None
        # kopf reports the handler's PermanentError as an Event (and does not retry it)
        failure = wait_for(lambda: [e for e in events(kube, "broken") if "failed permanently" in e["message"]],
                           what="kopf's permanent-failure Event")
        assert "spec.rollout.canary.tenants" in failure[0]["message"]
        assert "InvalidSpec" in reasons(kube, "broken")
        kube.patch(API_VERSION, KIND, "llm", "broken", {"spec": {"rollout": {"trafficRouting": GATEWAY}}})
        status = wait_for_status(kube, "broken", lambda s: s.get("phase") == "Healthy", what="fixed")
        assert condition(status, "InvalidSpec") is None


def test_fields_the_spec_drops_leave_the_workloads(kube, deployments, run_operator):
    """Server-side apply removes what the operator applied before and the new spec leaves out."""
    with run_operator():
        kube.create(sitsdeployment("pinned", gpuProduct="NVIDIA-H100-80GB-HBM3"))
        first = wait_for_status(kube, "pinned", lambda s: s.get("phase") == "Healthy", what="Healthy")
        pod = deployment(kube, "pinned", "stable")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        kube.patch(API_VERSION, KIND, "llm", "pinned", {"spec": {"gpuProduct": None}})  # no steps: straight through
        wait_for_status(kube, "pinned", lambda s: s.get("phase") == "Healthy"
                        and s.get("stableRevision") != first["stableRevision"], what="the new revision stable")
        for track in ("stable", "canary"):
            assert "nodeSelector" not in deployment(kube, "pinned", track)["spec"]["template"]["spec"]
