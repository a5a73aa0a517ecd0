"""spec.engine.kvCacheDtype / kvCacheScales: parsed and validated by the CRD and the operator, rendered into
`sits serve --kv-cache-dtype fp8 --kv-cache-scales ...` in the Deployment, and absent from stored specs (so
their revisions) when left at auto / static."""

from __future__ import annotations

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
from sits.runtime.cli import build_parser
from sits.runtime.commands.engine_args import engine_config_from_args
from sits.runtime.hardware import CPU_DEFAULTS
from tests.operator.helpers import serve_args

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "sitsdeployment.yaml").read_text())
CRD = yaml.safe_load((ROOT / "crds" / "sitsdeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
OWNER = Owner(name="llama3-8b", namespace="llm", uid="0f6c1d2e-uid")


def spec_with(engine: dict | None = None, **extra):
    body = copy.deepcopy(EXAMPLE["spec"])
    body["engine"] = {**body.get("engine", {}), **(engine or {})}
    body.update(extra)
    return parse_spec(body, "llama3-8b")


def stable_args(spec) -> list[str]:
    plan = Plan(TrackPlan(spec.workload, "r", 1), TrackPlan(spec.workload, "r", 0))
    built = {(o["kind"], o["metadata"]["name"]): o for o in build_all(OWNER, spec, plan, None)}
    return built[("Deployment", "llama3-8b-stable")]["spec"]["template"]["spec"]["containers"][0]["args"]


def schema_errors(engine: dict) -> list[str]:
    body = {"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "metadata": {},
            "spec": {**EXAMPLE["spec"], "engine": engine}}
    return [error.message for error in jsonschema.Draft4Validator(SCHEMA).iter_errors(body)]


@pytest.mark.parametrize("scales", ["static", "calibrate"])
def test_kv_cache_dtype_fp8_reaches_the_serve_flags_and_round_trips(scales):
    spec = spec_with({"kvCacheDtype": "fp8", "kvCacheScales": scales}, gpusPerReplica=1)
    args = stable_args(spec)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert args[args.index("--kv-cache-scales") + 1] == scales
    parsed = build_parser().parse_args(serve_args(args))  # flags `sits serve` takes, into its cache config
    cache = engine_config_from_args(parsed, CPU_DEFAULTS).cache
    assert (cache.kv_cache_dtype, cache.kv_cache_scales) == ("fp8", scales)
    assert parse_workload(spec.workload.to_dict(), "status.stableSpec") == spec.workload
    assert revision_of(OWNER, spec.workload) != revision_of(OWNER, spec_with().workload)  # a change is a canary
    assert schema_errors({"kvCacheDtype": "fp8", "kvCacheScales": scales}) == []


def test_left_at_auto_nothing_changes():
    spec = spec_with()
    assert "--kv-cache-dtype" not in stable_args(spec) and "--kv-cache-scales" not in stable_args(spec)
    engine = spec.workload.to_dict()["engine"]
    assert "kvCacheDtype" not in engine and "kvCacheScales" not in engine  # stored specs keep their revision
    assert spec_with({"kvCacheDtype": "auto", "kvCacheScales": "static"}).workload == spec.workload


@pytest.mark.parametrize(("engine", "message"), [
    ({"kvCacheDtype": "fp16"}, "spec.engine.kvCacheDtype: must be one of auto, fp8, got 'fp16'"),
    ({"kvCacheDtype": 8}, "spec.engine.kvCacheDtype"),
    ({"kvCacheDtype": "fp8", "kvCacheScales": "dynamic"}, "spec.engine.kvCacheScales: must be one of static, calibrate"),
])
def test_bad_values_are_a_spec_error_and_a_schema_error(engine, message):
    with pytest.raises(SpecError, match=message):
        spec_with(engine)
    assert schema_errors(engine)


def test_calibrated_scales_need_an_fp8_cache_and_one_gpu_per_replica():
    with pytest.raises(SpecError, match="spec.engine.kvCacheScales: applies to an fp8 cache only"):
        spec_with({"kvCacheScales": "calibrate"})
    with pytest.raises(SpecError, match="spec.engine.kvCacheScales: calibrate runs with one GPU per replica only"):
        spec_with({"kvCacheDtype": "fp8", "kvCacheScales": "calibrate"}, gpusPerReplica=2)
    args = stable_args(spec_with({"kvCacheDtype": "fp8"}, gpusPerReplica=2))  # static scales shard with the heads
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8" and "--tensor-parallel-size" in args
