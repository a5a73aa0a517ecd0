"""spec.model.loraAdapters: the parsed spec, the runtime pod built from it, and the CRD agreeing with the operator."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from sits.operator.fields import SpecError
from sits.operator.meta import Owner
from sits.operator.revisions import revision_of
from sits.operator.spec import parse_spec, parse_workload
from sits.operator.workloads import HF_CACHE_DIR, build_pod_template
from sits.runtime.cli import build_parser
from sits.runtime.commands.engine_args import lora_config_from_args
from sits.runtime.lora.config import LoraModule
from tests.operator.helpers import serve_args
from tests.operator.test_autoscaling import crd_violations
from tests.operator.test_crd import api_server_defaults

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "sitsdeployment.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
OWNER = Owner("llm-a", "llm", "uid-1")
ADAPTERS = [{"name": "sql", "uri": "pvc://models/adapters/sql"},       # the base model's claim
            {"name": "poet", "uri": "pvc://adapters/poet/v2/"},         # another claim, a nested path
            {"name": "whole", "uri": "pvc://adapters"},                 # a whole claim
            {"name": "support", "uri": "hf://org/support-lora@v1"},     # the runtime downloads it
            {"name": "baked", "uri": "file:///opt/adapters/baked"}]     # inside the image


def spec_with(adapters: Any = None, *, engine: dict | None = None, model: dict | None = None,
              **fields: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "base", "uri": "pvc://models/llama", **(model or {})}, "image": "sits:1",
                            **fields}
    if adapters is not None:
        spec["model"]["loraAdapters"] = copy.deepcopy(adapters)
    if engine is not None:
        spec["engine"] = engine
    return spec


def container_of(spec: dict[str, Any], track: str | None = "stable") -> tuple[dict[str, Any], dict[str, Any]]:
    template = build_pod_template(OWNER, parse_spec(spec, OWNER.name).workload, track, "rev" if track else None)
    return template["spec"]["containers"][0], template["spec"]


def lora_flags(args: list[str]) -> list[str]:
    return args[args.index("--enable-lora"):args.index("--track") if "--track" in args else None]


def test_every_kind_of_uri_becomes_a_lora_module_the_runtime_reads():
    container, pod = container_of(spec_with(ADAPTERS, engine={"maxLoraRank": 64}))
    assert lora_flags(container["args"]) == [
        "--enable-lora", "--lora-modules", "sql=/mnt/lora/sql", "poet=/mnt/lora/poet", "whole=/mnt/lora/whole",
        "support=hf://org/support-lora@v1", "baked=/opt/adapters/baked", "--max-loras", "5", "--max-lora-rank", "64"]
    # The runtime's own parser reads the pod's arguments back into its LoRA config
    config = lora_config_from_args(build_parser().parse_args(serve_args(container["args"])))
    assert config.enable_lora and (config.max_loras, config.max_lora_rank) == (5, 64)
    assert config.modules[0] == LoraModule("sql", "/mnt/lora/sql")
    assert [m.name for m in config.modules] == ["sql", "poet", "whole", "support", "baked"]
    assert build_parser().parse_args(serve_args(container["args"])).track == "stable"


def test_pvc_adapters_are_read_only_subpath_mounts_and_hub_adapters_get_the_hf_cache():
    container, pod = container_of(spec_with(ADAPTERS))
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # the base model's claim is mounted once and serves the adapter on it too
    assert mounts["/mnt/lora/sql"] == {"name": "model", "mountPath": "/mnt/lora/sql", "readOnly": True,
                                       "subPath": "adapters/sql"}
    assert mounts["/mnt/lora/poet"] == {"name": "lora-0", "mountPath": "/mnt/lora/poet", "readOnly": True,
                                        "subPath": "poet/v2"}
    assert mounts["/mnt/lora/whole"] == {"name": "lora-0", "mountPath": "/mnt/lora/whole", "readOnly": True}
    assert volumes["lora-0"] == {"name": "lora-0", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}}
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v] \
        == ["models", "adapters"]
    # the base model is on a PVC, but an adapter comes from the Hub: HF_HOME is the writable emptyDir
    assert {"name": "HF_HOME", "value": HF_CACHE_DIR} in container["env"]
    assert mounts[HF_CACHE_DIR]["name"] == "hf-cache" and volumes["hf-cache"] == {"name": "hf-cache", "emptyDir": {}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x", "namespace": "llm"},
                  "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
                      "metadata": {"labels": {"a": "b"}}, "spec": pod}}}
    kubernetes_validate.validate(deployment, "1.33", strict=True)


def test_file_adapters_need_no_volume_and_no_hub_cache():
    container, pod = container_of(spec_with([{"name": "baked", "uri": "file:///opt/adapters/baked"}]))
    assert lora_flags(container["args"])[2:] == ["baked=/opt/adapters/baked", "--max-loras", "1",
                                                 "--max-lora-rank", "16"]
    assert not any(m["mountPath"].startswith("/mnt/lora") for m in container["volumeMounts"])
    assert "HF_HOME" not in {e["name"] for e in container["env"]} and "hf-cache" not in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize(("adapters", "engine"), [(None, None), ([], None), (None, {"maxLoraRank": 16}),
                                                  (None, {"maxLoras": 2})],
                         ids=["absent", "empty", "default-rank", "slots-without-adapters"])
def test_without_adapters_the_pod_template_and_revision_do_not_change(adapters, engine):
    plain = parse_spec(spec_with(), OWNER.name).workload
    workload = parse_spec(spec_with(adapters, engine=engine), OWNER.name).workload
    assert revision_of(OWNER, workload) == revision_of(OWNER, plain)
    assert "--enable-lora" not in build_pod_template(OWNER, workload)["spec"]["containers"][0]["args"]


def test_an_adapter_change_is_a_new_revision_and_the_stable_copy_round_trips():
    first = parse_spec(spec_with(ADAPTERS[:1]), OWNER.name).workload
    moved = parse_spec(spec_with([{"name": "sql", "uri": "pvc://models/adapters/sql-v2"}]), OWNER.name).workload
    added = parse_spec(spec_with(ADAPTERS[:2]), OWNER.name).workload
    ranked = parse_spec(spec_with(ADAPTERS[:1], engine={"maxLoraRank": 8}), OWNER.name).workload
    assert len({revision_of(OWNER, w) for w in (first, moved, added, ranked)}) == 4
    for workload in (first, added, ranked, parse_spec(spec_with(ADAPTERS, engine={"maxLoras": 8}), "x").workload):
        assert parse_workload(workload.to_dict(), "status.stableSpec") == workload  # the stable track's copy


INVALID = [
    (spec_with([{"name": "sql"}]), "spec.model.loraAdapters[0].uri", "is required"),
    (spec_with([{"uri": "hf://org/a"}]), "spec.model.loraAdapters[0].name", "is required"),
    (spec_with([{"name": "has space", "uri": "hf://org/a"}]), "spec.model.loraAdapters[0].name", "OpenAI model id"),
    (spec_with([{"name": "a=b", "uri": "hf://org/a"}]), "spec.model.loraAdapters[0].name", "OpenAI model id"),
    (spec_with([{"name": "sql", "uri": "s3://bucket/sql"}]), "spec.model.loraAdapters[0].uri", "hf://org/name"),
    (spec_with([{"name": "sql", "uri": "pvc://models/../secrets"}]), "spec.model.loraAdapters[0].uri", "'..'"),
    (spec_with([{"name": "sql", "uri": "hf://org/a", "rank": 8}]), "spec.model.loraAdapters[0].rank",
     "unknown field"),
    (spec_with([{"name": "base", "uri": "hf://org/a"}]), "spec.model.loraAdapters[0].name", "base model's name"),
    (spec_with([{"name": "sql", "uri": "hf://org/a"}, {"name": "sql", "uri": "hf://org/b"}]),
     "spec.model.loraAdapters[1].name", "appears twice"),
    (spec_with("sql=hf://org/a"), "spec.model.loraAdapters", "must be a list"),
    (spec_with(ADAPTERS[:2], engine={"maxLoras": 1}), "spec.engine.maxLoras", "at least the number"),
    (spec_with(ADAPTERS[:1], engine={"maxLoras": 0}), "spec.engine.maxLoras", ">= 1"),
    (spec_with(ADAPTERS[:1], engine={"maxLoraRank": 0}), "spec.engine.maxLoraRank", ">= 1"),
    (spec_with(ADAPTERS[:1], engine={"maxLoraRank": "16"}), "spec.engine.maxLoraRank", "an integer"),
    (spec_with(ADAPTERS[:1], model={"quantization": "fp8"}), "spec.model.loraAdapters", "unquantized"),
    (spec_with(ADAPTERS[:1], gpusPerReplica=2), "spec.model.loraAdapters", "tensor parallelism"),
]
INVALID_IDS = ["no-uri", "no-name", "space", "equals", "scheme", "dot-dot", "unknown-field", "base-name",
               "duplicate", "not-a-list", "too-few-slots", "zero-slots", "zero-rank", "string-rank",
               "quantized", "tensor-parallel"]


@pytest.mark.parametrize(("spec", "path", "words"), INVALID, ids=INVALID_IDS)
def test_invalid_adapters_are_spec_errors_naming_the_field(spec, path, words):
    with pytest.raises(SpecError) as raised:
        parse_spec(spec, OWNER.name)
    assert raised.value.path == path and words in raised.value.message, str(raised.value)


def test_the_default_model_name_is_the_resources_name_and_no_adapter_may_take_it():
    spec = spec_with([{"name": OWNER.name, "uri": "hf://org/a"}])
    del spec["model"]["name"]
    with pytest.raises(SpecError, match=r"^spec\.model\.loraAdapters\[0\]\.name: 'llm-a' is the base model's name"):
        parse_spec(spec, OWNER.name)
    assert not crd_accepts(spec)  # the CRD's root rule reads metadata.name
    spec["model"]["loraAdapters"][0]["name"] = "sql"
    assert crd_accepts(spec) and parse_spec(spec, OWNER.name).workload.lora.adapters[0].name == "sql"


# -- the CRD: its OpenAPI schema and CEL rules accept and refuse what the operator does -------------------

def crd_accepts(spec: dict[str, Any]) -> bool:
    body = {"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "metadata": {"name": OWNER.name},
            "spec": api_server_defaults(SPEC_SCHEMA, copy.deepcopy(spec))}
    try:
        jsonschema.Draft4Validator(SCHEMA).validate(body)
    except jsonschema.ValidationError:
        return False
    environment = celpy.Environment()
    root_rules = [environment.program(environment.compile(rule["rule"]))
                  for rule in SCHEMA.get("x-kubernetes-validations") or []]  # these may read metadata.name
    if not all(rule.evaluate({"self": celpy.json_to_cel(body)}) for rule in root_rules):
        return False
    return not crd_violations(SPEC_SCHEMA, body["spec"], "spec")


@pytest.mark.parametrize(("spec", "path", "words"), INVALID, ids=INVALID_IDS)
def test_the_crd_refuses_what_the_operator_refuses(spec, path, words):
    assert not crd_accepts(spec), f"the CRD lets through what fails with {path}: {words}"


@pytest.mark.parametrize("spec", [
    spec_with(ADAPTERS),
    spec_with(ADAPTERS[:1], engine={"maxLoras": 3, "maxLoraRank": 64}, gpusPerReplica=0),
    spec_with([], engine={"maxLoras": 1}, model={"quantization": "fp8"}, gpusPerReplica=4),
    spec_with([{"name": "a.b_c-1", "uri": "pvc://models/a..b/c"}]),
], ids=["every-uri", "slots-and-rank-on-cpu", "empty-list-anything-goes", "dots-inside-names"])
def test_the_crd_and_the_operator_accept_the_same_and_default_the_same(spec):
    assert crd_accepts(spec)
    defaulted = api_server_defaults(SPEC_SCHEMA, copy.deepcopy(spec))
    assert parse_spec(defaulted, OWNER.name) == parse_spec(spec, OWNER.name)


def test_the_full_example_serves_adapters_from_a_pvc_and_the_hub():
    body = yaml.safe_load((ROOT / "examples" / "sitsdeployment-full.yaml").read_text())
    # (the CEL rules and list keys; resources and nccl.env are free-form maps crd_violations does not walk)
    checked = {key: value for key, value in body["spec"].items() if key not in ("resources", "nccl")}
    assert crd_violations(SPEC_SCHEMA, checked, "spec") == []
    workload = parse_spec(body["spec"], body["metadata"]["name"]).workload
    args = build_pod_template(OWNER, workload, "stable", "rev")["spec"]["containers"][0]["args"]
    assert lora_flags(args) == ["--enable-lora", "--lora-modules", "sql=/mnt/lora/sql",
                                "support=hf://example-org/llama-3-8b-support-lora@v2", "--max-loras", "4",
                                "--max-lora-rank", "32"]
