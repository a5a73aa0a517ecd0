"""spec.router end to end against KMock: the operator runs `sits router` in front of the replicas.

KMock runs no pods: `deployments` marks Deployments ready as kube-controller-manager would. The test
reads what the operator wrote: the router's Deployment (its `sits router` flags, parsed by the
router's own parser), Service, ServiceAccount, Role and RoleBinding; the model's Service selecting
the router pods; the canary weight reaching the router's flags during a rollout without a Gateway
API; everything router-shaped deleted when the router is disabled; InvalidSpec for a bad policy.
"""

from __future__ import annotations

import argparse

from sits.operator.meta import API_VERSION, DEPLOYMENT_LABEL, KIND
from sits.operator.router_workloads import ROUTER_LABEL
from sits.runtime.router.command import add_arguments
from tests.operator.helpers import condition, events, set_image, sitsdeployment, wait_for, wait_for_status

MODEL = {"name": "tiny", "uri": "file:///models/tiny.gguf"}
ROUTER = {"enabled": True, "replicas": 2, "policy": "precise", "weights": {"prefix": 2, "waiting": 0.5}}
REDIS = {"redis": {"url": "redis://sits-redis:6379/0"}}
ROUTER_OBJECTS = (("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
                  ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("apps/v1", "Deployment"), ("v1", "Service"))


def router_deployment(kube, name: str) -> dict | None:
    return kube.get("apps/v1", "Deployment", "llm", f"{name}-router")


def router_flags(kube, name: str) -> argparse.Namespace:
    args = router_deployment(kube, name)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "router"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(args[1:])


def selector(kube, name: str) -> dict:
    return kube.get("v1", "Service", "llm", name)["spec"]["selector"]


def test_router_is_deployed_follows_the_rollout_and_is_removed(kube, deployments, run_operator):
    with run_operator():
        kube.create(sitsdeployment("routed", model=MODEL, tenancy=REDIS, router=ROUTER,
                                   rollout={"canary": {"steps": [{"setWeight": 30}, {"pause": {}}],
                                                       "tenants": ["beta"]}}))
        wait_for_status(kube, "routed", lambda s: s.get("phase") == "Healthy", what="Healthy")
        uid = kube.get(API_VERSION, KIND, "llm", "routed")["metadata"]["uid"]
        for api_version, kind in ROUTER_OBJECTS:
            obj = wait_for(lambda v=api_version, k=kind: kube.get(v, k, "llm", "routed-router"), what=kind)
            assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        role = kube.get("rbac.authorization.k8s.io/v1", "Role", "llm", "routed-router")
        assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                  "verbs": ["get", "list", "watch"]}]
        binding = kube.get("rbac.authorization.k8s.io/v1", "RoleBinding", "llm", "routed-router")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "routed-router", "namespace": "llm"}]
        router = router_deployment(kube, "routed")
        assert router["spec"]["replicas"] == 2
        assert router["spec"]["template"]["spec"]["serviceAccountName"] == "routed-router"
        flags = router_flags(kube, "routed")
        assert flags.discover == ["llm/routed-stable", "llm/routed-canary"]
        assert (flags.state_store, flags.deployment, flags.policy, flags.weights) == (
            "redis://sits-redis:6379/0", "llm.routed", "precise", "prefix=2,waiting=0.5")
        assert (flags.model, flags.served_model_name, flags.canary_weight) == ("/models/tiny.gguf", "tiny", 0)
        # The model's Service selects the router; the track Services keep the runtime pods
        assert selector(kube, "routed") == {ROUTER_LABEL: "routed"}
        assert selector(kube, "routed-router") == {ROUTER_LABEL: "routed"}
        assert selector(kube, "routed-stable") == {DEPLOYMENT_LABEL: "routed", "track": "stable"}

        # A canary without a Gateway API: the router applies its weight and tenants
        set_image(kube, "routed", "registry.example.com/sits:2")
        wait_for_status(kube, "routed", lambda s: s.get("phase") == "Paused" and s.get("canaryWeight") == 30,
                        timeout_s=20, what="Paused at 30 %")
        wait_for(lambda: router_flags(kube, "routed").canary_weight == 30, what="the router's canary weight")
        assert router_flags(kube, "routed").canary_tenants == "beta"
        assert router_flags(kube, "routed").model == "/models/tiny.gguf"  # the stable track's tokenizer
        kube.patch(API_VERSION, KIND, "llm", "routed", {"metadata": {"annotations": {"sits.ai/promote": "full"}}})
        wait_for_status(kube, "routed", lambda s: s.get("phase") == "Healthy" and not s.get("canaryRevision"),
                        timeout_s=20, what="promoted")
        wait_for(lambda: router_flags(kube, "routed").canary_weight == 0, what="the canary weight back to 0")

        # Disabled (canary tenants need the router without a Gateway API, so they go too): every
        # router object goes, and the model's Service selects the replicas again
        kube.patch(API_VERSION, KIND, "llm", "routed", {"spec": {"router": {"enabled": False},
                                                                 "rollout": {"canary": {"tenants": None}}}})
        wait_for(lambda: all(kube.get(v, k, "llm", "routed-router") is None for v, k in ROUTER_OBJECTS),
                 timeout_s=20, what="the router objects deleted")
        wait_for(lambda: selector(kube, "routed") == {DEPLOYMENT_LABEL: "routed"}, what="the Service back on replicas")
        assert kube.get("apps/v1", "Deployment", "llm", "routed-stable") is not None
        assert kube.get("v1", "Service", "llm", "routed-stable") is not None


def test_an_invalid_router_policy_is_an_invalid_spec(kube, deployments, run_operator):
    with run_operator():
        kube.create(sitsdeployment("badrouter", model=MODEL, router={"enabled": True, "policy": "random"}))
        status = wait_for_status(kube, "badrouter", lambda s: condition(s, "InvalidSpec"), what="InvalidSpec")
        assert condition(status, "InvalidSpec")["message"] == (
            "spec.router.policy: must be one of precise, approximate, least-loaded, round-robin, got 'random'")
        assert status["phase"] == "Degraded"
        assert router_deployment(kube, "badrouter") is None
        wait_for(lambda: [e for e in events(kube, "badrouter") if e["reason"] == "InvalidSpec"], what="an Event")
        # Fixed: the router comes up
        kube.patch(API_VERSION, KIND, "llm", "badrouter", {"spec": {"router": {"policy": "least-loaded"}}})
        wait_for(lambda: router_deployment(kube, "badrouter"), what="the router Deployment")
        assert router_flags(kube, "badrouter").policy == "least-loaded"
        wait_for_status(kube, "badrouter", lambda s: not condition(s, "InvalidSpec"), what="valid")
