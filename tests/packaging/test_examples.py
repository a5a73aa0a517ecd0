"""The examples: SitsDeployments valid for the CRD's schema and the operator, a tenants file the runtime reads."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from sits.operator.spec import parse_spec
from sits.runtime.tenancy.tenants import load_tenants_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CRD = yaml.safe_load((ROOT / "crds" / "sitsdeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
# Kubernetes reads OpenAPI v3.0 schemas: JSON Schema draft 4 plus x-kubernetes-* extensions
VALIDATOR = jsonschema.Draft4Validator(SCHEMA)
SITSDEPLOYMENTS = ["sitsdeployment.yaml", "sitsdeployment-full.yaml", "sitsdeployment-minimal.yaml"]


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def schema_paths(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Every property path under `schema` (`a.b`, list items as `a[].b`)."""
    paths = []
    for key, sub in (schema.get("properties") or {}).items():
        paths.append(prefix + key)
        if sub.get("type") == "object":
            paths += schema_paths(sub, f"{prefix}{key}.")
        elif sub.get("type") == "array" and (sub.get("items") or {}).get("type") == "object":
            paths += schema_paths(sub["items"], f"{prefix}{key}[].")
    return paths


def is_set(document: Any, path: str) -> bool:
    values = [document]
    for part in path.split("."):
        key, many = (part[:-2], True) if part.endswith("[]") else (part, False)
        found = []
        for value in values:
            if isinstance(value, dict) and key in value:
                found += value[key] if many and isinstance(value[key], list) else [value[key]]
        values = found
    return bool(values)


@pytest.mark.parametrize("name", SITSDEPLOYMENTS)
def test_the_example_is_valid_for_the_crd_schema_and_the_operator(name):
    body = load(name)
    VALIDATOR.validate(body)
    assert body["apiVersion"] == f"{CRD['spec']['group']}/{CRD['spec']['versions'][0]['name']}"
    assert body["kind"] == CRD["spec"]["names"]["kind"]
    parse_spec(body["spec"], body["metadata"]["name"])  # the operator's own checks (raises SpecError)


def test_the_minimal_example_sets_only_what_is_required_and_runs_on_cpu():
    spec = load("sitsdeployment-minimal.yaml")["spec"]
    assert set(spec) == set(SCHEMA["properties"]["spec"]["required"]) | {"gpusPerReplica"}
    assert spec["gpusPerReplica"] == 0


def test_the_full_example_sets_every_field_of_the_schema():
    spec_schema = SCHEMA["properties"]["spec"]
    missing = [path for path in schema_paths(spec_schema) if not is_set(load("sitsdeployment-full.yaml")["spec"], path)]
    assert missing == [], f"examples/sitsdeployment-full.yaml does not show: {missing}"


@pytest.mark.parametrize(("path", "value"), [
    (("spec", "image"), None),
    (("spec", "replicas"), -1),
    (("spec", "model", "uri"), "s3://bucket/model"),
    (("spec", "model", "quantization"), "int4"),
    (("spec", "engine", "kvBlockSize"), 24),
    (("spec", "tenancy", "tenants", 0, "kvCacheShare"), 1.5),
    (("spec", "rollout", "canary", "steps", 1, "pause", "duration"), "five minutes"),
    (("spec", "rollout", "canary", "analysis", "maxDeltaMs"), "fifty"),
    (("spec", "tracing", "otlpEndpoint"), "otel-collector:4317"),
])
def test_an_invalid_sitsdeployment_fails_the_schema(path, value):
    body = copy.deepcopy(load("sitsdeployment-full.yaml"))
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(body)


def test_the_tenants_file_is_what_sits_serve_reads():
    table = load_tenants_file(str(EXAMPLES / "tenants.yaml"), require_keys=True)
    assert table.names == ["finance", "research", "beta"] and table.requires_auth
    raw = load("tenants.yaml")
    by_name = {tenant["name"]: tenant for tenant in raw["tenants"]}
    assert by_name["research"].get("apiKeySha256") and "apiKey" not in by_name["research"]
