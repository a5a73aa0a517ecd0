"""The CRD: its schema accepts the example, rejects what the API server must, and defaults as the operator does."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from sits.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "sitsdeployment.yaml").read_text())
EXAMPLE = yaml.safe_load((ROOT / "examples" / "sitsdeployment.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
# OpenAPI v3.0 (as Kubernetes reads it) is JSON Schema draft 4 plus x-kubernetes-* extensions
VALIDATOR = jsonschema.Draft4Validator(SCHEMA)


def api_server_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does to `value` (defaults of present objects)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = api_server_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [api_server_defaults(schema["items"], item) for item in value]
    return value


def test_names_columns_and_subresources():
    names = CRD["spec"]["names"]
    assert (CRD["spec"]["group"], names["kind"], names["plural"]) == ("sits.ai", "SitsDeployment", "sitsdeployments")
    assert names["shortNames"] == ["sitsd"]
    assert VERSION["name"] == "v1alpha1" and VERSION["served"] and VERSION["storage"]
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert columns == {"Phase": ".status.phase", "Stable": ".status.stableRevision", "Canary": ".status.canaryRevision",
                       "Weight": ".status.canaryWeight", "Ready": ".status.ready", "Age": ".metadata.creationTimestamp"}
    assert VERSION["subresources"]["status"] == {}
    assert VERSION["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert SCHEMA["properties"]["spec"]["required"] == ["image", "model"]


def test_the_example_validates_against_the_schema():
    VALIDATOR.validate(EXAMPLE)
    assert EXAMPLE["apiVersion"] == f"{CRD['spec']['group']}/{VERSION['name']}"


@pytest.mark.parametrize(("path", "value"), [
    ("image", None),
    ("model", None),
    ("replicas", -1),
    ("gpusPerReplica", "one"),
    ("model.quantization", "int4"),
    ("model.uri", "s3://bucket/model"),
    ("engine.kvBlockSize", 24),
    ("engine.gpuMemoryUtilization", 0),
    ("rollout.canary.steps", [{"setWeight": 10, "pause": {}}]),
    ("rollout.canary.steps", [{"setWeight": 101}]),
    ("rollout.canary.steps", [{"pause": {"duration": "5 minutes"}}]),
    ("rollout.canary.analysis.quantile", 1.0),
    ("rollout.canary.analysis.failureLimit", 0),
    ("tenancy.tenants", [{"name": "x"}]),
    ("router", {"enabled": True, "policy": "random"}),
    ("router", {"replicas": 0}),
    ("router", {"weights": {"prefix": -1}}),
    ("tenancy.tenants", [{"name": "x", "priority": 9, "apiKeySecretRef": {"name": "s", "key": "k"}}]),
])
def test_the_schema_rejects(path, value):
    body = copy.deepcopy(EXAMPLE)
    node = body["spec"]
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(body)


@pytest.mark.parametrize("spec", [
    {"model": {"uri": "hf://org/tiny"}, "image": "sits:1"},
    {"model": {"uri": "hf://org/tiny"}, "image": "sits:1", "engine": {}, "nccl": {}, "monitoring": {}, "router": {},
     "rollout": {"canary": {"analysis": {"prometheus": {"url": "http://p:9090"}, "maxDeltaMs": 5}},
                 "trafficRouting": {"gatewayAPI": {"httpRoute": "r"}}},
     "tenancy": {"tenants": [{"name": "a", "apiKeySecretRef": {"name": "s", "key": "k"}}]}},
    EXAMPLE["spec"],
], ids=["minimal", "every-defaulted-object", "design-example"])
def test_crd_defaults_are_the_operators_defaults(spec):
    """A spec defaulted by the API server parses exactly like the same spec left undefaulted."""
    defaulted = api_server_defaults(SCHEMA["properties"]["spec"], copy.deepcopy(spec))
    assert defaulted != spec or spec is EXAMPLE["spec"]
    VALIDATOR.validate({"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "metadata": {}, "spec": defaulted})
    assert parse_spec(defaulted, "demo") == parse_spec(spec, "demo")


MAXIMAL = {
    "model": {"name": "m", "uri": "pvc://models/m", "dtype": "float16", "quantization": "none", "maxModelLen": 4096,
              "loraAdapters": [{"name": "sql", "uri": "pvc://models/adapters/sql"}]},
    "image": "sits:1", "imagePullPolicy": "IfNotPresent", "replicas": 3, "gpusPerReplica": 1,
    "gpuProduct": "NVIDIA-H200", "resources": {"requests": {"cpu": "8"}, "limits": {"memory": "64Gi"}},
    "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.8, "kvBlockSize": 32,
               "cudaGraphs": False, "maxLoras": 2, "maxLoraRank": 32, "hostKvCacheGb": 64, "kvCacheDtype": "fp8",
               "kvCacheScales": "calibrate"},
    "nccl": {"socketNThreads": 4, "minChannels": 2, "env": {"NCCL_DEBUG": "INFO"}},
    "tenancy": {"redis": {"url": "redis://r:6379/0"},
                "tenants": [{"name": "a", "priority": 2, "kvCacheShare": 0.5, "hostKvCacheShare": 0.5,
                             "apiKeySecretRef": {"name": "s", "key": "k"},
                             "limits": {"requestsPerMinute": 60, "tokensPerMinute": 6000},
                             "models": ["m", "sql"]}]},
    "rollout": {
        "canary": {"steps": [{"setWeight": 20}, {"pause": {"duration": "30s"}}], "tenants": ["a"],
                   "analysis": {"prometheus": {"url": "http://p:9090"}, "quantile": 0.99, "maxDeltaMs": 20,
                                "interval": "30s", "failureLimit": 3, "inconclusiveLimit": 5, "window": "2m",
                                "timeout": "5s"}},
        "trafficRouting": {"gatewayAPI": {"httpRoute": "r", "hostnames": ["llm.example.com"], "tenantHeader": "x-t",
                                          "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                                          "name": "gw", "namespace": "infra", "sectionName": "https",
                                                          "port": 443}]}}},
    "monitoring": {"serviceMonitor": True, "prometheusRule": True},
    "tracing": {"otlpEndpoint": "http://otel-collector:4318"},
    "router": {"enabled": True, "replicas": 2, "policy": "precise",
               "weights": {"prefix": 1.0, "running": 0.1, "waiting": 0.2, "kv": 0.3}},
    "autoscaling": {"minReplicas": 2, "maxReplicas": 6,
                    "metrics": [{"type": "cpu", "targetUtilization": 70}, {"type": "waitingRequests", "targetAverage": 4}],
                    "behavior": {direction: {"stabilizationWindowSeconds": 60, "selectPolicy": "Max",
                                             "policies": [{"type": "Pods", "value": 1, "periodSeconds": 30}]}
                                 for direction in ("scaleUp", "scaleDown")}},
}


def schema_leaves(schema: dict[str, Any], prefix: str = ""):
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        if "properties" in sub:
            yield from schema_leaves(sub, path)
        elif "properties" in sub.get("items", {}):
            yield from schema_leaves(sub["items"], path + "[]")
        else:
            yield path


def value_leaves(value: Any, schema: dict[str, Any], prefix: str = ""):
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in value.items():
            yield from value_leaves(sub, schema["properties"][key], f"{prefix}.{key}" if prefix else key)
    elif isinstance(value, list) and "properties" in schema.get("items", {}):
        for item in value:
            yield from value_leaves(item, schema["items"], prefix + "[]")
    else:
        yield prefix


def test_every_field_the_crd_allows_the_operator_accepts():
    spec_schema = SCHEMA["properties"]["spec"]
    assert set(value_leaves(MAXIMAL, spec_schema)) == set(schema_leaves(spec_schema))  # MAXIMAL covers the CRD
    VALIDATOR.validate({"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "metadata": {}, "spec": MAXIMAL})
    parsed = parse_spec(MAXIMAL, "demo")
    assert parsed.rollout.gateway_api.parent_refs[0] == tuple(sorted(MAXIMAL["rollout"]["trafficRouting"]
                                                                      ["gatewayAPI"]["parentRefs"][0].items()))
    assert parsed.workload.resources == (("requests", (("cpu", "8"),)), ("limits", (("memory", "64Gi"),)))
    assert parsed.workload.otlp_endpoint == "http://otel-collector:4318"
    assert parsed.router.weights_arg() == "prefix=1,running=0.1,waiting=0.2,kv=0.3"


def test_every_status_field_the_operator_writes_survives_pruning():
    """A structural schema prunes unknown fields: all rollout state must be declared, or it is lost."""
    from sits.operator.status import AnalysisState, Status

    status_schema = SCHEMA["properties"]["status"]["properties"]
    written = Status(phase="Progressing", observed_generation=2, stable_revision="a", stable_spec={"image": "x"},
                     canary_revision="b", canary_started_at=1.0, canary_weight=10, current_step=1, step_started_at=2.0,
                     pause_reason="CanaryPauseStep", aborted_revision="c",
                     abort_request={"revision": "b", "reason": "AlertFiring", "message": "m", "requestedAt": "t"},
                     analysis=AnalysisState(last_delta_ms=1.0, last_result="Passed", last_run_at=3.0, next_run_at=4.0,
                                            message="m", consecutive_failures=1, consecutive_inconclusive=1),
                     replicas=3, ready_replicas=3, ready="3/3", selector="s",
                     conditions=[{"type": "Healthy", "status": "True", "reason": "Ready", "message": "",
                                  "lastTransitionTime": "t"}]).to_dict()
    assert set(written) <= set(status_schema)
    assert set(written["analysis"]) <= set(status_schema["analysis"]["properties"])
    assert set(written["abortRequest"]) <= set(status_schema["abortRequest"]["properties"])
    tenancy = {"synced", "reason", "message", "tenants", "digest"}  # written by Reconciler.sync_tenants
    assert tenancy <= set(status_schema["tenancy"]["properties"])
    VALIDATOR.validate({**EXAMPLE, "status": {**written, "tenancy": dict.fromkeys(tenancy, "x") | {
        "synced": True, "tenants": 1}}})
