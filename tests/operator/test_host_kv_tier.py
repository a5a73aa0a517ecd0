"""spec.engine.hostKvCacheGb and spec.tenancy.tenants[].hostKvCacheShare: parsed, validated by the CRD
and the operator, rendered into `--host-kv-cache-gb` and the tenants file, and added to the pod's
memory request (pinned host memory counts against the pod)."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from sits.operator.builders import build_all
from sits.operator.meta import Owner
from sits.operator.plan import Plan, TrackPlan
from sits.operator.revisions import revision_of
from sits.operator.spec import SpecError, parse_spec, parse_workload
from sits.operator.tenants import resolve_tenants
from sits.operator.workloads import memory_mib
from sits.runtime.cli import build_parser
from sits.runtime.tenancy.tenants import parse_tenants
from tests.operator.helpers import serve_args

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "sitsdeployment.yaml").read_text())
CRD = yaml.safe_load((ROOT / "crds" / "sitsdeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
OWNER = Owner(name="llama3-8b", namespace="llm", uid="0f6c1d2e-uid")


def spec_with(engine: dict | None = None, resources: dict | None = None, **extra):
    body = copy.deepcopy(EXAMPLE["spec"])
    body["engine"] = {**body.get("engine", {}), **(engine or {})}
    if resources is not None:
        body["resources"] = resources
    body.update(extra)
    return parse_spec(body, "llama3-8b")


def stable(spec, tenants=None) -> dict:
    plan = Plan(TrackPlan(spec.workload, "r", 1), TrackPlan(spec.workload, "r", 0))
    built = {(o["kind"], o["metadata"]["name"]): o for o in build_all(OWNER, spec, plan, tenants)}
    return built[("Deployment", "llama3-8b-stable")]["spec"]["template"]["spec"]["containers"][0]


def test_host_kv_cache_gb_reaches_the_runtime_flag_and_round_trips():
    spec = spec_with({"hostKvCacheGb": 96})
    args = stable(spec)["args"]
    assert args[args.index("--host-kv-cache-gb") + 1] == "96"
    assert build_parser().parse_args(serve_args(args)).host_kv_cache_gb == 96  # a flag `sits serve` takes
    assert parse_workload(spec.workload.to_dict(), "status.stableSpec") == spec.workload
    assert revision_of(OWNER, spec.workload) != revision_of(OWNER, spec_with().workload)


def test_without_the_tier_nothing_changes():
    spec = spec_with()
    assert "--host-kv-cache-gb" not in stable(spec)["args"]
    assert "hostKvCacheGb" not in spec.workload.to_dict()["engine"]  # stored specs keep their revision
    assert spec_with({"hostKvCacheGb": 0}).workload == spec.workload


@pytest.mark.parametrize(("resources", "expected"), [
    (None, {"requests": {"memory": "65536Mi"}}),
    ({"requests": {"memory": "32Gi", "cpu": "8"}}, {"requests": {"memory": "98304Mi", "cpu": "8"}}),
    ({"requests": {"memory": "32Gi"}, "limits": {"memory": "40G"}},
     {"requests": {"memory": "98304Mi"}, "limits": {"memory": f"{memory_mib('40G') + 65536}Mi"}}),
])
def test_the_pods_memory_request_and_limit_grow_by_the_tier(resources, expected):
    container = stable(spec_with({"hostKvCacheGb": 64}, resources=resources))
    got = {kind: {k: v for k, v in values.items() if k != "nvidia.com/gpu"}
           for kind, values in container["resources"].items()}
    assert {kind: values for kind, values in got.items() if values} == expected


def test_memory_quantities_are_read_in_every_kubernetes_unit():
    assert memory_mib("1Gi") == 1024 and memory_mib("1G") == 954 and memory_mib("512Mi") == 512
    assert memory_mib("1073741824") == 1024 and memory_mib("1e9") == 954 and memory_mib("1Ki") == 1
    with pytest.raises(ValueError):
        memory_mib("lots")


@pytest.mark.parametrize("value", [-1, "big", True, 70000])
def test_bad_host_kv_cache_gb_is_a_spec_error_and_a_schema_error(value):
    with pytest.raises(SpecError, match="spec.engine.hostKvCacheGb"):
        spec_with({"hostKvCacheGb": value})
    body = {"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "metadata": {},
            "spec": {**EXAMPLE["spec"], "engine": {"hostKvCacheGb": value}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(SCHEMA).validate(body)


def test_tenant_host_share_reaches_the_tenants_file_the_runtime_reads():
    tenancy = copy.deepcopy(EXAMPLE["spec"]["tenancy"])
    tenancy["tenants"][0]["hostKvCacheShare"] = 0.75
    spec = spec_with({"hostKvCacheGb": 8}, tenancy=tenancy)
    assert spec.tenancy.tenants[0].host_kv_cache_share == 0.75
    secret = {tenancy["tenants"][0]["apiKeySecretRef"]["key"]: base64.b64encode(b"sk-0123456789").decode()}
    records = resolve_tenants(spec.tenancy, lambda name: secret).records
    document = {"tenants": [record.to_document() for record in records]}
    assert document["tenants"][0]["hostKvCacheShare"] == 0.75
    assert parse_tenants(document).host_shares()[records[0].name] == 0.75  # the runtime's parser takes it


def test_host_shares_over_one_are_refused():
    tenancy = copy.deepcopy(EXAMPLE["spec"]["tenancy"])
    first = tenancy["tenants"][0]
    tenancy["tenants"] = [{**first, "name": "a", "hostKvCacheShare": 0.6},
                          {**first, "name": "b", "kvCacheShare": 0, "hostKvCacheShare": 0.6}]
    with pytest.raises(SpecError, match="hostKvCacheShare values sum to 1.2"):
        spec_with(tenancy=tenancy)
