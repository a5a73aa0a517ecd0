"""spec.autoscaling against an emulated API server: the operator runs (kopf), the test plays the HPA.

KMock has no HPA controller; the test writes `spec.replicas` through the SitsDeployment's scale
subresource as the HPA controller (and `kubectl scale`) does, and checks the operator follows.
"""

from __future__ import annotations

from typing import Any

from sits.operator.kube import KubeClient
from sits.operator.meta import API_VERSION, KIND
from tests.operator.helpers import (
    condition,
    deployment,
    events,
    set_image,
    sitsdeployment,
    status_of,
    wait_for,
    wait_for_status,
)

HPA = ("autoscaling/v2", "HorizontalPodAutoscaler")
AUTOSCALING = {"minReplicas": 2, "maxReplicas": 5, "metrics": [{"type": "waitingRequests", "targetAverage": 4},
                                                              {"type": "kvCacheUsage", "targetAverage": 0.8}],
               "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}}


def hpa(kube: KubeClient, name: str) -> dict[str, Any] | None:
    return kube.get(*HPA, "llm", name)


def scale(kube: KubeClient, name: str, replicas: int) -> None:
    """Write the Scale's spec.replicas, which the CRD maps to .spec.replicas: the HPA controller's write,
    sent as `kubectl scale` sends it (a merge patch of the scale subresource)."""
    kube.patch(API_VERSION, KIND, "llm", name, {"spec": {"replicas": replicas}}, subresource="scale")


def selects(selector: str, labels: dict[str, str]) -> bool:
    """A `k=v,k2=v2` label selector (what status.selector holds) matches these labels."""
    required = dict(part.split("=", 1) for part in selector.split(","))
    return all(labels.get(key) == value for key, value in required.items())


def replicas_of(kube: KubeClient, name: str, track: str) -> int:
    return (deployment(kube, name, track) or {}).get("spec", {}).get("replicas", -1)


def test_the_operator_owns_an_hpa_that_scales_the_sitsdeployment(kube, deployments, run_operator):
    with run_operator():
        kube.create(sitsdeployment("auto", replicas=1, autoscaling=AUTOSCALING))
        status = wait_for_status(kube, "auto", lambda s: s.get("phase") == "Healthy", what="Healthy")
        # spec.replicas 1 is below minReplicas: the operator starts at 2, where the HPA would put it
        assert status["ready"] == "2/2" and replicas_of(kube, "auto", "stable") == 2
        owner = kube.get(API_VERSION, KIND, "llm", "auto")
        made = wait_for(lambda: hpa(kube, "auto"), what="the HorizontalPodAutoscaler")
        assert made["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
        assert made["metadata"]["ownerReferences"][0]["controller"] is True
        assert made["spec"]["scaleTargetRef"] == {"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment",
                                                  "name": "auto"}
        assert (made["spec"]["minReplicas"], made["spec"]["maxReplicas"]) == (2, 5)
        assert [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in made["spec"]["metrics"]] \
            == [("sits_requests_waiting", "4"), ("sits_kv_cache_usage_ratio", "800m")]
        assert made["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 600}}
        # The scale subresource's selector (status.selector) finds the pods of both tracks
        for track in ("stable", "canary"):
            pod_labels = deployment(kube, "auto", track)["spec"]["template"]["metadata"]["labels"]
            assert selects(status["selector"], pod_labels), (status["selector"], track)

        scale(kube, "auto", 4)  # the HPA scales up
        wait_for(lambda: replicas_of(kube, "auto", "stable") == 4, what="the stable Deployment at 4")
        wait_for_status(kube, "auto", lambda s: s.get("ready") == "4/4" and s.get("replicas") == 4, what="4/4")
        assert replicas_of(kube, "auto", "canary") == 0 and status_of(kube, "auto")["stableRevision"] == status["stableRevision"]

        # A new template rolls out at the HPA's replica count and leaves spec.replicas to the HPA
        set_image(kube, "auto", "registry.example.com/sits:2")
        wait_for_status(kube, "auto", lambda s: s.get("phase") == "Healthy"
                        and s.get("stableRevision") != status["stableRevision"], what="the new revision stable")
        assert kube.get(API_VERSION, KIND, "llm", "auto")["spec"]["replicas"] == 4
        assert replicas_of(kube, "auto", "stable") == 4

        # Dropping spec.autoscaling deletes the HPA; the replicas it chose stay
        kube.patch(API_VERSION, KIND, "llm", "auto", {"spec": {"autoscaling": None}})
        wait_for(lambda: hpa(kube, "auto") is None, timeout_s=10, what="the HPA deleted")
        assert replicas_of(kube, "auto", "stable") == 4 and status_of(kube, "auto")["phase"] == "Healthy"


def test_invalid_autoscaling_is_a_condition_and_changes_nothing(kube, deployments, run_operator):
    with run_operator():
        # Refused outright: nothing is created
        kube.create(sitsdeployment("wrong", autoscaling={"minReplicas": 4, "maxReplicas": 2}))
        status = wait_for_status(kube, "wrong", lambda s: condition(s, "InvalidSpec"), what="InvalidSpec")
        invalid = condition(status, "InvalidSpec")
        assert invalid["message"] == "spec.autoscaling.maxReplicas: must be >= minReplicas (4), got 2"
        assert status["phase"] == "Degraded"
        assert deployment(kube, "wrong", "stable") is None and hpa(kube, "wrong") is None
        wait_for(lambda: [e for e in events(kube, "wrong") if e["reason"] == "InvalidSpec"], what="an Event")

        # Broken later: the HPA and the workloads stay as they were until the spec is fixed
        kube.create(sitsdeployment("later", autoscaling={"maxReplicas": 3, "metrics": [
            {"type": "runningRequests", "targetAverage": 16}]}))
        wait_for_status(kube, "later", lambda s: s.get("phase") == "Healthy", what="Healthy")
        before = wait_for(lambda: hpa(kube, "later"), what="the HPA")
        kube.patch(API_VERSION, KIND, "llm", "later", {"spec": {"autoscaling": {"metrics": [{"type": "gpu"}]}}})
        status = wait_for_status(kube, "later", lambda s: condition(s, "InvalidSpec"), what="InvalidSpec")
        assert condition(status, "InvalidSpec")["message"].startswith("spec.autoscaling.metrics[0].type: must be one of")
        assert hpa(kube, "later")["spec"] == before["spec"]
        kube.patch(API_VERSION, KIND, "llm", "later", {"spec": {"autoscaling": {"metrics": [
            {"type": "waitingRequests", "targetAverage": 2}]}}})
        wait_for(lambda: (hpa(kube, "later") or {}).get("spec", {}).get("metrics", [{}])[0].get("pods", {})
                 .get("metric", {}).get("name") == "sits_requests_waiting", what="the HPA updated")
        assert condition(wait_for_status(kube, "later", lambda s: not condition(s, "InvalidSpec"), what="valid"),
                         "InvalidSpec") is None

