"""The chart's RBAC grants exactly the API calls the operator makes: recorded, not guessed.

A real operator (kopf handlers in KopfRunner) runs a SitsDeployment's whole life against the
emulated API server, which records every (verb, resource) the operator's token asks for: create
with tenants, Gateway API route, ServiceMonitor, PrometheusRule and HorizontalPodAutoscaler; owned
objects edited behind its back (drift it repairs); a canary promoted; a canary rolled back by an
Alertmanager alert; the optional objects dropped from the spec (deleted); the resource deleted. The rendered
ClusterRole (and Role, when the chart watches one namespace) must equal that set, plus what the
operator grants without calling it: the router's Role (spec.router) reads EndpointSlices, and
Kubernetes refuses to create a Role granting more than its creator holds.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kmock
import kopf
import kubernetes.config
import kubernetes.config.kube_config
import pytest
from kopf.testing import KopfRunner

from sits.operator.config import OperatorConfig
from sits.operator.handlers import register
from sits.operator.kube import KubeClient
from sits.operator.meta import API_VERSION, KIND
from tests.operator.deployment_controller import DeploymentController
from tests.operator.helpers import WEBHOOK_TOKEN, sitsdeployment, wait_for, wait_for_status
from tests.packaging.api_recorder import ApiCall, RecordingCluster
from tests.packaging.chart import objects, rbac_rules
from tests.support.services import free_port

NAMESPACE = "llm"
NAME = "full"
PEERING_VERBS = {"list", "watch", "get", "create", "patch", "delete"}
PEERING_RESOURCES = {  # kopf's peering CRDs, for runs with --peering
    "kopf.dev/v1/kopfpeerings": kmock.ResourceInfo(namespaced=True, kind="KopfPeering", singular="kopfpeering",
                                                   verbs=PEERING_VERBS),
    "kopf.dev/v1/clusterkopfpeerings": kmock.ResourceInfo(namespaced=False, kind="ClusterKopfPeering",
                                                          singular="clusterkopfpeering", verbs=PEERING_VERBS),
}
TAMPERED = {"metadata": {"labels": {"app.kubernetes.io/name": "edited-by-hand"}}}
DRIFTED = [("v1", "Service", NAME), ("policy/v1", "PodDisruptionBudget", NAME),
           ("monitoring.coreos.com/v1", "ServiceMonitor", NAME), ("monitoring.coreos.com/v1", "PrometheusRule", NAME),
           ("autoscaling/v2", "HorizontalPodAutoscaler", NAME)]
ROUTER_DRIFTED = [("v1", "ServiceAccount", f"{NAME}-router"), ("rbac.authorization.k8s.io/v1", "Role", f"{NAME}-router"),
                  ("rbac.authorization.k8s.io/v1", "RoleBinding", f"{NAME}-router")]
# Permissions the operator holds only to grant them to the router's Role (RBAC escalation check)
GRANTED = {("discovery.k8s.io", "endpointslices", verb) for verb in ("get", "list", "watch")}
ROUTER = {"enabled": True, "policy": "least-loaded"}  # the helper's model is hf://, which precise refuses
AUTOSCALING = {"maxReplicas": 4, "metrics": [{"type": "waitingRequests", "targetAverage": 8}]}


@pytest.fixture
def recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingCluster]:
    cluster = RecordingCluster(tmp_path, PEERING_RESOURCES).start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))
        yield cluster
    finally:
        cluster.stop()


def driver_client(cluster: RecordingCluster) -> KubeClient:
    """The test's own client: another token, so its calls are not the operator's."""
    api = kubernetes.config.new_client_from_config(config_file=str(cluster.driver_kubeconfig), persist_config=False)
    return KubeClient(api, timeout_s=10)


def post_alert(port: int) -> None:
    alert = {"status": "firing", "labels": {"alertname": "SitsCanaryP95Delta", "namespace": NAMESPACE,
                                            "sitsdeployment": NAME},
             "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/alertmanager", method="POST",
                                     data=json.dumps({"status": "firing", "alerts": [alert]}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {WEBHOOK_TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def full_life(kube: KubeClient, webhook_port: int) -> None:
    """Everything the operator does to one SitsDeployment, start to end."""
    kube.create({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "finance-key", "namespace": NAMESPACE},
                 "data": {"token": "c2stZmluYW5jZQ=="}})
    tenants = [{"name": "finance", "priority": 3, "kvCacheShare": 0.4,
                "apiKeySecretRef": {"name": "finance-key", "key": "token"}}]
    steps = [{"setWeight": 50}, {"pause": {"duration": "1s"}}]
    kube.create(sitsdeployment(NAME, NAMESPACE, tenancy={"tenants": tenants},
                               rollout={"canary": {"steps": steps}, "trafficRouting": {"gatewayAPI": {"httpRoute": NAME}}},
                               monitoring={"serviceMonitor": True, "prometheusRule": True},
                               autoscaling=AUTOSCALING, router=ROUTER))
    first = wait_for_status(kube, NAME, lambda s: s.get("phase") == "Healthy", namespace=NAMESPACE, what="Healthy")
    # Drift: hand edits of owned objects and a deleted Deployment; the next full pass repairs them
    for api_version, kind, name in DRIFTED + ROUTER_DRIFTED:
        kube.patch(api_version, kind, NAMESPACE, name, TAMPERED)
    kube.delete("apps/v1", "Deployment", NAMESPACE, f"{NAME}-canary")
    wait_for(lambda: all((kube.get(v, k, NAMESPACE, n) or {}).get("metadata", {}).get("labels", {})
                         .get("app.kubernetes.io/name") == "sits" for v, k, n in DRIFTED + ROUTER_DRIFTED),
             what="drift repaired")
    # A canary that promotes, then one an alert rolls back
    kube.patch(API_VERSION, KIND, NAMESPACE, NAME, {"spec": {"image": "registry.example.com/sits:2"}})
    wait_for_status(kube, NAME, lambda s: s.get("phase") == "Healthy" and s["stableRevision"] != first["stableRevision"],
                    namespace=NAMESPACE, timeout_s=20, what="promoted")
    kube.patch(API_VERSION, KIND, NAMESPACE, NAME, {"spec": {"image": "registry.example.com/sits:3",
                                                             "rollout": {"canary": {"steps": [{"setWeight": 50},
                                                                                              {"pause": {}}]}}}})
    wait_for_status(kube, NAME, lambda s: s.get("phase") == "Paused", namespace=NAMESPACE, timeout_s=20, what="Paused")
    post_alert(webhook_port)
    wait_for_status(kube, NAME, lambda s: s.get("phase") == "RolledBack", namespace=NAMESPACE, what="RolledBack")
    # Optional objects dropped from the spec are deleted
    kube.patch(API_VERSION, KIND, NAMESPACE, NAME, {"spec": {"monitoring": None, "rollout": {"trafficRouting": None},
                                                             "autoscaling": None, "router": None}})
    wait_for(lambda: all(kube.get(v, k, NAMESPACE, n) is None for v, k, n in DRIFTED[2:])
             and kube.get("gateway.networking.k8s.io/v1", "HTTPRoute", NAMESPACE, NAME) is None
             and kube.get("apps/v1", "Deployment", NAMESPACE, f"{NAME}-router") is None
             and kube.get("rbac.authorization.k8s.io/v1", "RoleBinding", NAMESPACE, f"{NAME}-router") is None,
             timeout_s=20, what="optional objects deleted")
    kube.delete(API_VERSION, KIND, NAMESPACE, NAME)
    time.sleep(0.5)  # the deletion handler


def record_operator(cluster: RecordingCluster, watch_namespace: str | None, peering: str | None) -> set[ApiCall]:
    kube = driver_client(cluster)
    kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    if peering and watch_namespace:
        kube.request("POST", f"/apis/kopf.dev/v1/namespaces/{watch_namespace}/kopfpeerings",
                     {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": peering}})
    elif peering:
        kube.request("POST", "/apis/kopf.dev/v1/clusterkopfpeerings",
                     {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}})
    config = OperatorConfig(namespace=watch_namespace, listen_host="127.0.0.1", webhook_port=free_port(),
                            webhook_token=WEBHOOK_TOKEN,
                            resync_interval_s=0.3, tenancy_interval_s=0.5, health_port=0, peering=peering)
    registry = kopf.OperatorRegistry()
    register(registry, config)
    scope = ["--namespace", watch_namespace] if watch_namespace else ["--all-namespaces"]
    mode = ["--peering", peering] if peering else ["--standalone"]
    try:
        with DeploymentController(kube), KopfRunner(["run", *mode, *scope], registry=registry, timeout=30) as runner:
            full_life(kube, config.webhook_port)
    finally:
        kube.close()
    assert runner.exception is None, runner.output[-3000:]
    return cluster.calls


def as_rules(calls: set[ApiCall]) -> set[tuple[str, str, str]]:
    return {(call.group, call.resource, call.verb) for call in calls}


@pytest.mark.parametrize("peering", [None, "sits"], ids=["standalone", "peering"])
def test_watching_all_namespaces_the_cluster_role_is_exactly_what_the_operator_calls(recording, peering):
    calls = record_operator(recording, None, peering)
    assert {("sits.ai", "sitsdeployments", "watch"), ("apps", "deployments", "patch"),
            ("monitoring.coreos.com", "prometheusrules", "delete"),
            ("autoscaling", "horizontalpodautoscalers", "delete"),
            ("rbac.authorization.k8s.io", "rolebindings", "delete")} <= as_rules(calls), "the run was not complete"
    objs = objects({"operator": {"peering": peering or ""}})
    assert not [o for o in objs if o["kind"] in ("Role", "RoleBinding")]
    assert rbac_rules(objs, "ClusterRole") == as_rules(calls) | GRANTED


@pytest.mark.parametrize("peering", [None, "sits"], ids=["standalone", "peering"])
def test_watching_one_namespace_a_role_there_and_a_cluster_role_for_the_rest(recording, peering):
    calls = record_operator(recording, NAMESPACE, peering)
    objs = objects({"operator": {"watchNamespace": NAMESPACE, "peering": peering or ""}})
    assert rbac_rules(objs, "Role") == as_rules({c for c in calls if not c.cluster_wide}) | GRANTED
    assert rbac_rules(objs, "ClusterRole") == as_rules({c for c in calls if c.cluster_wide})
    role_binding = next(o for o in objs if o["kind"] == "RoleBinding")
    assert role_binding["metadata"]["namespace"] == NAMESPACE
    assert role_binding["subjects"][0]["namespace"] == "sits-system"


def test_no_rule_uses_a_wildcard():
    for values in ({}, {"operator": {"watchNamespace": NAMESPACE, "peering": "sits"}}):
        for role in (o for o in objects(values) if o["kind"] in ("ClusterRole", "Role")):
            for rule in role["rules"]:
                assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
