"""spec.router: parsing, and the router's Deployment, Service and RBAC (pure builders, no cluster)."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sits.operator.builders import PRUNED_KINDS, build_all
from sits.operator.fields import SpecError
from sits.operator.meta import DEPLOYMENT_LABEL, Owner
from sits.operator.plan import Plan, TrackPlan
from sits.operator.revisions import revision_of
from sits.operator.router_workloads import ROUTER_KINDS, ROUTER_LABEL, router_args
from sits.operator.spec import parse_spec
from sits.operator.spec_router import POLICIES
from sits.runtime.router.command import add_arguments, config_from_args
from sits.runtime.router.config import Policy, ScoringWeights
from tests.operator.test_autoscaling import crd_violations
from tests.operator.test_crd import api_server_defaults

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "sitsdeployment.yaml").read_text())["spec"]
OWNER = Owner(name="llama3-8b", namespace="llm", uid="0f6c1d2e-uid")
ROUTER = {"enabled": True, "replicas": 2, "policy": "precise", "weights": {"prefix": 1.5, "kv": 0.25}}


def spec_with(router=None, **changes):
    body = copy.deepcopy(EXAMPLE)
    if router is not None:
        body["router"] = router
    body.update(changes)
    return parse_spec(body, OWNER.name)


def plan_of(spec, weight=0, active=False):
    revision = revision_of(OWNER, spec.workload)
    return Plan(stable=TrackPlan(spec.workload, revision, 2), canary=TrackPlan(spec.workload, revision, 1 if active else 0),
                canary_weight=weight, canary_active=active)


def objects(spec, plan=None):
    return {(o["kind"], o["metadata"]["name"]): o for o in build_all(OWNER, spec, plan or plan_of(spec), None)}


def stable_args_of(spec):
    return objects(spec)[("Deployment", "llama3-8b-stable")]["spec"]["template"]["spec"]["containers"][0]["args"]


def router_flags(args):
    """The container's args as `sits router` parses them (the real parser)."""
    assert args[0] == "router"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(args[1:])


def test_policies_are_the_routers():
    assert tuple(policy.value for policy in Policy) == POLICIES
    assert set(spec_with(ROUTER).router.weights_arg().replace("=", ",").split(",")[::2]) <= set(
        ScoringWeights.__dataclass_fields__)


def test_router_defaults_and_disabled_builds_nothing():
    spec = spec_with()
    assert (spec.router.enabled, spec.router.replicas, spec.router.policy, spec.router.weights) == (False, 1, "precise", ())
    built = objects(spec)
    assert not [name for name in built if name[1] == "llama3-8b-router"]
    assert built[("Service", "llama3-8b")]["spec"]["selector"] == {DEPLOYMENT_LABEL: "llama3-8b"}


@pytest.mark.parametrize(("router", "changes", "path", "words"), [
    ({"enabled": True, "policy": "random"}, {}, "spec.router.policy", "precise, approximate"),
    ({"replicas": 0}, {}, "spec.router.replicas", ">= 1"),
    ({"weights": {"prefix": -1}}, {}, "spec.router.weights.prefix", ">= 0"),
    ({"weights": {"load": 1}}, {}, "spec.router.weights.load", "prefix"),
    ({"enabled": "yes"}, {}, "spec.router.enabled", "true or false"),
    ({"enabled": True}, {"model": {"uri": "hf://org/tiny"}}, "spec.router.policy", "pvc:// or file://"),
])
def test_invalid_router_specs_name_the_field(router, changes, path, words):
    with pytest.raises(SpecError) as error:
        spec_with(router, **changes)
    assert error.value.path == path and words in error.value.message


def test_canary_tenants_without_gateway_need_the_router():
    rollout = {"canary": {"steps": [{"setWeight": 10}], "tenants": ["beta"]}}
    with pytest.raises(SpecError, match="spec.router.enabled"):
        spec_with(rollout=rollout)
    assert spec_with(ROUTER, rollout=rollout).rollout.canary.tenants == ("beta",)
    # an hf:// model is fine for the policies that need no replica-exact hashes
    assert spec_with({"enabled": True, "policy": "approximate"}, model={"uri": "hf://org/tiny"}).router.enabled


def test_router_objects_are_owned_valid_and_prunable():
    built = objects(spec_with(ROUTER))
    names = {("ServiceAccount", "llama3-8b-router"), ("Role", "llama3-8b-router"), ("RoleBinding", "llama3-8b-router"),
             ("Deployment", "llama3-8b-router"), ("Service", "llama3-8b-router")}
    assert names <= set(built)
    assert {kind for _, kind in ROUTER_KINDS} <= {kind for _, kind in PRUNED_KINDS}
    for name in names:
        obj = built[name]
        assert obj["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
        assert obj["metadata"]["labels"][DEPLOYMENT_LABEL] == "llama3-8b"  # what pruning lists by
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_role_grants_endpointslices_read_only_in_the_namespace():
    built = objects(spec_with(ROUTER))
    role = built[("Role", "llama3-8b-router")]
    assert role["metadata"]["namespace"] == "llm"
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = built[("RoleBinding", "llama3-8b-router")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llama3-8b-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama3-8b-router", "namespace": "llm"}]
    pod = built[("Deployment", "llama3-8b-router")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llama3-8b-router"


def test_model_service_selects_the_router_and_tracks_keep_the_runtime_pods():
    built = objects(spec_with(ROUTER))
    router_pods = built[("Deployment", "llama3-8b-router")]["spec"]["template"]["metadata"]["labels"]
    assert built[("Service", "llama3-8b")]["spec"]["selector"] == {ROUTER_LABEL: "llama3-8b"}
    assert built[("Service", "llama3-8b-router")]["spec"]["selector"] == {ROUTER_LABEL: "llama3-8b"}
    for track in ("stable", "canary"):
        selector = built[("Service", f"llama3-8b-{track}")]["spec"]["selector"]
        assert selector == {DEPLOYMENT_LABEL: "llama3-8b", "track": track}
        assert not set(selector.items()) <= set(router_pods.items())
    # the runtime pods' PodDisruptionBudget does not count the router pods
    pdb = built[("PodDisruptionBudget", "llama3-8b")]["spec"]["selector"]["matchLabels"]
    assert not set(pdb.items()) <= set(router_pods.items())
    assert set(built[("Service", "llama3-8b")]["spec"]["selector"].items()) <= set(router_pods.items())


def test_router_deployment_runs_sits_router_small_and_without_gpu(monkeypatch):
    spec = spec_with(ROUTER)
    deployment = objects(spec)[("Deployment", "llama3-8b-router")]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com/sits-runtime:0.1.0"
    assert container["command"] == ["sits"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert "nvidia.com/gpu" not in str(container["resources"]) and "tolerations" not in pod
    assert container["resources"]["requests"] == {"cpu": "500m", "memory": "512Mi"}
    assert {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]} == {
        "/etc/sits": True, "/tmp": False, "/home/sits": False, "/mnt/models": True}
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    flags = router_flags(container["args"])
    assert flags.discover == ["llm/llama3-8b-stable", "llm/llama3-8b-canary"]
    assert flags.replica == []
    assert flags.replica_metrics_port == 9400  # the replicas' --metrics-port
    assert stable_args_of(spec)[stable_args_of(spec).index("--metrics-port") + 1] == "9400"
    assert (flags.state_store, flags.deployment, flags.tenants) == (
        "redis://sits-redis:6379/0", "llm.llama3-8b", "/etc/sits/tenants.yaml")  # as the replicas' flags
    assert (flags.policy, flags.weights) == ("precise", "prefix=1.5,kv=0.25")
    assert (flags.model, flags.served_model_name, flags.block_size) == (
        "/mnt/models/llama-3-8b", "llama-3-8b-instruct", 16)
    assert (flags.host, flags.port, flags.canary_weight, flags.canary_tenants) == ("0.0.0.0", 8080, 0, "")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    config = config_from_args(flags)
    config.validate()  # the router accepts what the operator writes
    assert config.weights == ScoringWeights(prefix=1.5, kv=0.25)
    stable_args = objects(spec)[("Deployment", "llama3-8b-stable")]["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag in ("--state-store", "--deployment", "--tenants", "--served-model-name"):
        assert stable_args[stable_args.index(flag) + 1] == getattr(flags, flag[2:].replace("-", "_"))
    assert stable_args[stable_args.index("--block-size") + 1] == str(flags.block_size)
    assert stable_args[stable_args.index("--model") + 1] == flags.model


def test_canary_weight_and_tenants_follow_the_rollout_without_gateway():
    rollout = {"canary": {"steps": [{"setWeight": 10}, {"pause": {}}], "tenants": ["beta", "gamma"]}}
    spec = spec_with(ROUTER, rollout=rollout)
    flags = router_flags(router_args(OWNER, spec, plan_of(spec, 10, active=True)))
    assert (flags.canary_weight, flags.canary_tenants) == (10, "beta,gamma")
    later = router_flags(router_args(OWNER, spec, plan_of(spec, 50, active=True)))
    assert later.canary_weight == 50
    idle = router_flags(router_args(OWNER, spec, plan_of(spec)))
    assert (idle.canary_weight, idle.canary_tenants) == (0, "")
    # a new weight is a new pod template: the router pods roll with the step
    templates = [objects(spec, plan_of(spec, w, active=True))[("Deployment", "llama3-8b-router")]["spec"]["template"]
                 for w in (10, 50)]
    assert templates[0] != templates[1]


def test_with_a_gateway_route_the_route_splits_and_the_router_does_not():
    spec = spec_with(ROUTER, rollout={"canary": {"steps": [{"setWeight": 10}], "tenants": ["beta"]},
                                      "trafficRouting": {"gatewayAPI": {"httpRoute": "llama3-8b"}}})
    flags = router_flags(router_args(OWNER, spec, plan_of(spec, 10, active=True)))
    assert (flags.canary_weight, flags.canary_tenants) == (0, "")


def test_router_without_redis_tenants_or_local_model():
    body = copy.deepcopy(EXAMPLE)
    body.pop("tenancy")
    body["model"] = {"uri": "hf://org/tiny"}
    body["rollout"] = {}
    body["router"] = {"enabled": True, "policy": "least-loaded"}
    spec = parse_spec(body, OWNER.name)
    flags = router_flags(router_args(OWNER, spec, plan_of(spec)))
    assert (flags.state_store, flags.tenants, flags.model, flags.weights) == ("memory://", None, None, "")
    pod = objects(spec)[("Deployment", "llama3-8b-router")]["spec"]["template"]["spec"]
    assert "model" not in {v["name"] for v in pod["volumes"]}


# -- the CRD: its schema and CEL rules accept and refuse what the operator does -------------------

CRD_SCHEMA = yaml.safe_load((ROOT / "crds" / "sitsdeployment.yaml").read_text())["spec"]["versions"][0]["schema"][
    "openAPIV3Schema"]


def crd_accepts(spec: dict) -> bool:
    body = {"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "metadata": {"name": "demo"},
            "spec": api_server_defaults(CRD_SCHEMA["properties"]["spec"], copy.deepcopy(spec))}
    try:
        jsonschema.Draft4Validator(CRD_SCHEMA).validate(body)
    except jsonschema.ValidationError:
        return False
    return not crd_violations(CRD_SCHEMA["properties"]["spec"], body["spec"], "spec")


def operator_accepts(spec: dict) -> bool:
    try:
        parse_spec(spec, "demo")
    except SpecError:
        return False
    return True


@pytest.mark.parametrize(("router", "model_uri", "accepted"), [
    ({}, "hf://org/tiny", True),
    ({"enabled": True}, "pvc://models/m", True),
    ({"enabled": True}, "hf://org/tiny", False),  # precise, the default, needs the model's tokenizer
    ({"enabled": True, "policy": "round-robin"}, "hf://org/tiny", True),
    ({"enabled": False}, "hf://org/tiny", True),
    ({"enabled": True, "policy": "random"}, "pvc://models/m", False),
    ({"replicas": 0}, "pvc://models/m", False),
    ({"weights": {"kv": -0.1}}, "pvc://models/m", False),
    ({"weights": {"prefix": 2, "running": 0, "waiting": 1, "kv": 0.5}, "replicas": 3}, "pvc://models/m", True),
])
def test_the_crd_and_the_operator_agree_on_router_specs(router, model_uri, accepted):
    spec = {"model": {"uri": model_uri}, "image": "sits:1", "router": router}
    assert crd_accepts(spec) is accepted
    assert operator_accepts(spec) is accepted
    if accepted:  # the API server's defaults change nothing the operator does
        defaulted = api_server_defaults(CRD_SCHEMA["properties"]["spec"], copy.deepcopy(spec))
        assert parse_spec(defaulted, "demo") == parse_spec(spec, "demo")
