"""spec.autoscaling: the parsed spec, the HorizontalPodAutoscaler built from it, and the CRD agreeing with both."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from sits.operator.autoscaling import build_horizontal_pod_autoscaler, quantity
from sits.operator.builders import OPTIONAL_KINDS, build_all
from sits.operator.fields import SpecError
from sits.operator.meta import Owner
from sits.operator.plan import Plan, TrackPlan
from sits.operator.spec import parse_spec
from sits.operator.spec_autoscaling import DEFAULT_CPU_UTILIZATION, POD_METRICS
from sits.runtime.server.metrics import EngineStatsCollector
from tests.operator.test_crd import api_server_defaults

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "sitsdeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
AUTOSCALING_SCHEMA = SCHEMA["properties"]["spec"]["properties"]["autoscaling"]
OWNER = Owner("llm-a", "llm", "uid-1")
BASE = {"model": {"uri": "hf://org/tiny"}, "image": "sits:1", "resources": {"requests": {"cpu": "4"}}}
EVERY_METRIC = [{"type": "cpu", "targetUtilization": 70}, {"type": "waitingRequests", "targetAverage": 4},
                {"type": "runningRequests", "targetAverage": 24}, {"type": "kvCacheUsage", "targetAverage": 0.75}]
BEHAVIOR = {"scaleUp": {"stabilizationWindowSeconds": 0, "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
            "scaleDown": {"stabilizationWindowSeconds": 600, "selectPolicy": "Min",
                          "policies": [{"type": "Percent", "value": 25, "periodSeconds": 300}]}}


def spec_with(autoscaling: Any, **fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(BASE), "autoscaling": copy.deepcopy(autoscaling), **fields}


def hpa_of(autoscaling: dict[str, Any]) -> dict[str, Any]:
    spec = parse_spec(spec_with(autoscaling), OWNER.name)
    assert spec.autoscaling is not None
    return build_horizontal_pod_autoscaler(OWNER, spec.autoscaling)


def test_the_hpa_scales_the_sitsdeployment_itself_on_every_metric():
    hpa = hpa_of({"minReplicas": 2, "maxReplicas": 8, "metrics": EVERY_METRIC, "behavior": BEHAVIOR})
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    assert (hpa["metadata"]["name"], hpa["metadata"]["namespace"]) == ("llm-a", "llm")
    assert hpa["metadata"]["ownerReferences"] == [OWNER.reference()]
    assert hpa["metadata"]["labels"]["sits.ai/deployment"] == "llm-a"  # how a full pass finds it to delete
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "name": "llm-a"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 8)
    assert spec["metrics"] == [
        {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}},
        {"type": "Pods", "pods": {"metric": {"name": "sits_requests_waiting"},
                                  "target": {"type": "AverageValue", "averageValue": "4"}}},
        {"type": "Pods", "pods": {"metric": {"name": "sits_requests_running"},
                                  "target": {"type": "AverageValue", "averageValue": "24"}}},
        {"type": "Pods", "pods": {"metric": {"name": "sits_kv_cache_usage_ratio"},
                                  "target": {"type": "AverageValue", "averageValue": "750m"}}},
    ]
    assert spec["behavior"] == BEHAVIOR  # passed through as the HPA spells it


@pytest.mark.parametrize("autoscaling", [
    {"maxReplicas": 3},
    {"minReplicas": 2, "maxReplicas": 8, "metrics": EVERY_METRIC, "behavior": BEHAVIOR},
    {"maxReplicas": 3, "metrics": [{"type": "kvCacheUsage", "targetAverage": 0.001}], "behavior": {"scaleUp": {}}},
], ids=["defaults", "everything", "smallest-target"])
def test_the_hpa_passes_the_kubernetes_schema_strictly(autoscaling):
    kubernetes_validate.validate(hpa_of(autoscaling), "1.33", strict=True)


def test_the_pod_metrics_are_gauges_the_runtime_exports():
    """A renamed runtime metric would leave the HPA without data: the names are the collector's own."""
    exported = {family.name: family.type for family in EngineStatsCollector(lambda: None, "m", "stable").describe()}
    for name in POD_METRICS.values():
        assert exported.get(name) == "gauge", f"{name} is not a gauge of runtime/server/metrics.py"


@pytest.mark.parametrize(("value", "expected"), [(4, "4"), (4.0, "4"), (0.75, "750m"), (2.5, "2500m"),
                                                 (0.001, "1m"), (100, "100")])
def test_targets_are_kubernetes_quantities(value, expected):
    assert quantity(value) == expected


def test_defaults_are_kserves():
    spec = parse_spec(spec_with({"maxReplicas": 3}), "demo")
    assert spec.autoscaling is not None
    assert (spec.autoscaling.min_replicas, spec.autoscaling.max_replicas) == (1, 3)
    assert [(m.type, m.target_utilization) for m in spec.autoscaling.metrics] == [("cpu", DEFAULT_CPU_UTILIZATION)]
    assert spec.autoscaling.scale_up is None and spec.autoscaling.scale_down is None
    assert "behavior" not in build_horizontal_pod_autoscaler(OWNER, spec.autoscaling)["spec"]
    assert parse_spec(BASE, "demo").autoscaling is None


@pytest.mark.parametrize(("replicas", "expected"), [(None, 2), (1, 2), (3, 3), (9, 5), (0, 0)],
                         ids=["defaulted", "below-min", "within", "above-max", "zero-turns-scaling-off"])
def test_replicas_start_within_the_bounds_before_the_hpa_acts(replicas, expected):
    extra = {} if replicas is None else {"replicas": replicas}
    spec = parse_spec(spec_with({"minReplicas": 2, "maxReplicas": 5}, **extra), "demo")
    assert spec.replicas == expected
    assert parse_spec({**BASE, **extra}, "demo").replicas == (1 if replicas is None else replicas)  # no autoscaling


def test_only_a_spec_with_autoscaling_builds_an_hpa_and_its_kind_is_deleted_when_dropped():
    assert ("autoscaling/v2", "HorizontalPodAutoscaler") in OPTIONAL_KINDS
    for autoscaling, count in ((None, 0), ({"maxReplicas": 3}, 1)):
        spec = parse_spec({**BASE, **({"autoscaling": autoscaling} if autoscaling else {})}, OWNER.name)
        track = TrackPlan(spec.workload, "rev", spec.replicas)
        built = build_all(OWNER, spec, Plan(stable=track, canary=track), None)
        assert [o["kind"] for o in built].count("HorizontalPodAutoscaler") == count


INVALID = [
    ({"minReplicas": 3, "maxReplicas": 2}, "spec.autoscaling.maxReplicas", ">= minReplicas (3)"),
    ({}, "spec.autoscaling.maxReplicas", "required"),
    ({"minReplicas": 0, "maxReplicas": 2}, "spec.autoscaling.minReplicas", ">= 1"),
    ({"maxReplicas": 2, "metrics": []}, "spec.autoscaling.metrics", "at least one metric"),
    ({"maxReplicas": 2, "metrics": [{"type": "gpu", "targetAverage": 1}]}, "spec.autoscaling.metrics[0].type",
     "must be one of cpu, waitingRequests, runningRequests, kvCacheUsage"),
    ({"maxReplicas": 2, "metrics": [{"type": "waitingRequests", "targetAverage": 2},
                                    {"type": "waitingRequests", "targetAverage": 3}]},
     "spec.autoscaling.metrics[1].type", "appears twice"),
    ({"maxReplicas": 2, "metrics": [{"type": "cpu", "targetAverage": 2}]}, "spec.autoscaling.metrics[0].targetAverage",
     "cpu takes targetUtilization"),
    ({"maxReplicas": 2, "metrics": [{"type": "cpu"}]}, "spec.autoscaling.metrics[0].targetUtilization", "required"),
    ({"maxReplicas": 2, "metrics": [{"type": "cpu", "targetUtilization": 120}]},
     "spec.autoscaling.metrics[0].targetUtilization", "<= 100"),
    ({"maxReplicas": 2, "metrics": [{"type": "runningRequests", "targetUtilization": 50}]},
     "spec.autoscaling.metrics[0].targetUtilization", "runningRequests takes targetAverage"),
    ({"maxReplicas": 2, "metrics": [{"type": "waitingRequests"}]}, "spec.autoscaling.metrics[0].targetAverage",
     "required"),
    ({"maxReplicas": 2, "metrics": [{"type": "kvCacheUsage", "targetAverage": 1.5}]},
     "spec.autoscaling.metrics[0].targetAverage", "<= 1"),
    ({"maxReplicas": 2, "metrics": [{"type": "waitingRequests", "targetAverage": 0}]},
     "spec.autoscaling.metrics[0].targetAverage", ">= 0.001"),
    ({"maxReplicas": 2, "scaleMetric": "cpu"}, "spec.autoscaling.scaleMetric", "unknown field"),
    ({"maxReplicas": 2, "behavior": {"scaleUp": {"selectPolicy": "Fast"}}},
     "spec.autoscaling.behavior.scaleUp.selectPolicy", "must be one of Max, Min, Disabled"),
    ({"maxReplicas": 2, "behavior": {"scaleDown": {"policies": []}}}, "spec.autoscaling.behavior.scaleDown.policies",
     "at least one policy"),
    ({"maxReplicas": 2, "behavior": {"scaleDown": {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 3600}]}}},
     "spec.autoscaling.behavior.scaleDown.policies[0].periodSeconds", "<= 1800"),
    ({"maxReplicas": 2, "behavior": {"scaleUp": {"stabilizationWindowSeconds": 7200}}},
     "spec.autoscaling.behavior.scaleUp.stabilizationWindowSeconds", "<= 3600"),
    ({"maxReplicas": 2, "behavior": {"scaleUp": {"tolerance": 0.1}}}, "spec.autoscaling.behavior.scaleUp.tolerance",
     "unknown field"),
]
INVALID_IDS = ["max-below-min", "no-max", "min-zero", "no-metrics", "unknown-type", "duplicate-type",
               "cpu-with-average", "cpu-without-target", "cpu-over-100", "average-type-with-utilization",
               "average-type-without-target", "kv-over-1", "zero-target", "kserve-field-name", "select-policy",
               "empty-policies", "policy-period", "stabilization-window", "unknown-behavior-field"]


@pytest.mark.parametrize(("autoscaling", "path", "words"), INVALID, ids=INVALID_IDS)
def test_invalid_autoscaling_names_the_field(autoscaling, path, words):
    with pytest.raises(SpecError) as raised:
        parse_spec(spec_with(autoscaling), "demo")
    assert raised.value.path == path and words in raised.value.message, str(raised.value)


def test_a_cpu_target_needs_a_cpu_request():
    """Utilization is a percent of the request: without one the HPA could never compute it."""
    for autoscaling, path in (({"maxReplicas": 2}, "spec.autoscaling.metrics"),  # the default metric
                              ({"maxReplicas": 2, "metrics": EVERY_METRIC}, "spec.autoscaling.metrics[0]")):
        with pytest.raises(SpecError) as raised:
            parse_spec({**BASE, "resources": {"limits": {"cpu": "4"}}, "autoscaling": autoscaling}, "demo")
        assert raised.value.path == path and "spec.resources.requests.cpu" in raised.value.message
    spec = parse_spec({**BASE, "resources": {}, "autoscaling": {"maxReplicas": 2, "metrics": EVERY_METRIC[1:]}}, "d")
    assert spec.autoscaling is not None and len(spec.autoscaling.metrics) == 3


# -- the CRD: its OpenAPI schema and CEL rules accept and refuse what the operator does -------------------

def _cel_value(schema: dict[str, Any], value: Any) -> Any:
    """A JSON value as the API server hands it to CEL: `number` fields are doubles even when written 1."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        return {k: _cel_value(props.get(k, {}), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cel_value(schema.get("items") or {}, v) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def crd_violations(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """What the API server refuses beyond JSON Schema: CEL rules, list-map keys, and unknown fields
    (kubectl's default `--validate=strict` asks for server-side field validation)."""
    found = []
    environment = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations") or []:
        program = environment.program(environment.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(_cel_value(schema, value))}):
            found.append(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        found += [f"{path}.{key}: unknown field" for key in value if key not in (schema.get("properties") or {})]
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                found += crd_violations(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list):
        if schema.get("x-kubernetes-list-type") == "map":
            keys = [tuple(item.get(k) for k in schema["x-kubernetes-list-map-keys"]) for item in value]
            if len(set(keys)) != len(keys):
                found.append(f"{path}: Duplicate value")
        for index, item in enumerate(value):
            found += crd_violations(schema.get("items") or {}, item, f"{path}[{index}]")
    return found


def crd_accepts(spec: dict[str, Any]) -> bool:
    body = {"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "metadata": {"name": "demo"},
            "spec": api_server_defaults(SCHEMA["properties"]["spec"], copy.deepcopy(spec))}
    try:
        jsonschema.Draft4Validator(SCHEMA).validate(body)
    except jsonschema.ValidationError:
        return False
    return not crd_violations(AUTOSCALING_SCHEMA, body["spec"]["autoscaling"], "spec.autoscaling")


@pytest.mark.parametrize(("autoscaling", "path", "words"), INVALID, ids=INVALID_IDS)
def test_the_crd_refuses_what_the_operator_refuses(autoscaling, path, words):
    assert not crd_accepts(spec_with(autoscaling)), f"the CRD lets through what fails with {path}: {words}"


@pytest.mark.parametrize("autoscaling", [
    {"maxReplicas": 1},
    {"minReplicas": 2, "maxReplicas": 8, "metrics": EVERY_METRIC, "behavior": BEHAVIOR},
    {"maxReplicas": 4, "metrics": [{"type": "kvCacheUsage", "targetAverage": 1}], "behavior": {}},
], ids=["defaults", "everything", "integer-fraction"])
def test_the_crd_and_the_operator_accept_the_same_and_default_the_same(autoscaling):
    spec = spec_with(autoscaling)
    assert crd_accepts(spec)
    defaulted = api_server_defaults(SCHEMA["properties"]["spec"], copy.deepcopy(spec))
    assert parse_spec(defaulted, "demo") == parse_spec(spec, "demo")


def test_the_autoscaling_example_leaves_replicas_to_the_hpa():
    body = yaml.safe_load((ROOT / "examples" / "sitsdeployment-autoscaling.yaml").read_text())
    assert "replicas" not in body["spec"]
    jsonschema.Draft4Validator(SCHEMA).validate(body)
    assert crd_violations(AUTOSCALING_SCHEMA, body["spec"]["autoscaling"]) == []
    spec = parse_spec(body["spec"], body["metadata"]["name"])
    assert spec.autoscaling is not None and spec.replicas == spec.autoscaling.min_replicas
    hpa = build_horizontal_pod_autoscaler(Owner(body["metadata"]["name"], "llm", "uid"), spec.autoscaling)
    kubernetes_validate.validate(hpa, "1.33", strict=True)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "sits_requests_waiting"
