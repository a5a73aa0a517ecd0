"""Pure builders: every object a SitsDeployment owns, checked field by field and against Kubernetes schemas."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sits.operator.builders import build_all
from sits.operator.meta import Owner
from sits.operator.monitoring import ALERT_NAME
from sits.operator.plan import Plan, TrackPlan
from sits.operator.revisions import revision_of
from sits.operator.spec import parse_spec, parse_workload
from sits.operator.tenants import resolve_tenants
from sits.runtime.cli import build_parser
from tests.operator.helpers import serve_args

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "sitsdeployment.yaml").read_text())
OWNER = Owner(name="llama3-8b", namespace="llm", uid="0f6c1d2e-uid")
SPEC = parse_spec(EXAMPLE["spec"], "llama3-8b")
REVISION = revision_of(OWNER, SPEC.workload)
CANARY_PLAN = Plan(stable=TrackPlan(SPEC.workload, REVISION, 2), canary=TrackPlan(SPEC.workload, REVISION, 1),
                   canary_weight=10, canary_active=True)
KEY = "sk-finance-0123456789"


def objects(spec=SPEC, plan=CANARY_PLAN, tenants=None):
    return {(o["kind"], o["metadata"]["name"]): o for o in build_all(OWNER, spec, plan, tenants)}


def container(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_everything_is_owned_by_the_sitsdeployment():
    built = objects()
    assert set(built) == {
        ("ConfigMap", "llama3-8b-engine"), ("Deployment", "llama3-8b-stable"), ("Deployment", "llama3-8b-canary"),
        ("Service", "llama3-8b"), ("Service", "llama3-8b-stable"), ("Service", "llama3-8b-canary"),
        ("PodDisruptionBudget", "llama3-8b"), ("HTTPRoute", "llama3-8b"), ("ServiceMonitor", "llama3-8b"),
        ("PrometheusRule", "llama3-8b")}
    for obj in built.values():
        assert obj["metadata"]["namespace"] == "llm"
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "name": "llama3-8b", "uid": OWNER.uid,
            "controller": True, "blockOwnerDeletion": True}]
        assert obj["metadata"]["labels"]["sits.ai/deployment"] == "llama3-8b"


def test_built_in_kinds_pass_the_kubernetes_schemas_strictly():
    for obj in objects().values():
        if obj["kind"] in ("HTTPRoute", "ServiceMonitor", "PrometheusRule"):
            continue  # no schemas offline for CRDs
        kubernetes_validate.validate(obj, "1.33", strict=True)


@pytest.mark.parametrize("track", ["stable", "canary"])
def test_deployment_of_a_track(track):
    deployment = objects()[("Deployment", f"llama3-8b-{track}")]
    pod = deployment["spec"]["template"]
    main = container(deployment)
    assert deployment["spec"]["replicas"] == (2 if track == "stable" else 1)
    assert deployment["spec"]["selector"]["matchLabels"] == {"sits.ai/deployment": "llama3-8b", "track": track}
    assert pod["metadata"]["labels"]["track"] == track and deployment["metadata"]["labels"]["track"] == track
    assert pod["metadata"]["labels"]["sits.ai/revision"] == REVISION
    assert deployment["metadata"]["annotations"]["sits.ai/revision"] == REVISION
    assert main["args"][main["args"].index("--track") + 1] == track
    assert main["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env["NCCL_SOCKET_NTHREADS"] == "8" and env["NCCL_MIN_NCHANNELS"] == "4" and env["NCCL_IB_DISABLE"] == "0"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    assert main["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for probe in ("livenessProbe", "startupProbe"):
        assert main[probe]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert main["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                             {"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"


def test_runtime_flags_follow_the_spec():
    args = container(objects()[("Deployment", "llama3-8b-stable")])["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[0] == "serve"
    assert flags["--model"] == "/mnt/models/llama-3-8b"  # pvc://models/llama-3-8b mounted read-only
    assert flags["--served-model-name"] == "llama-3-8b-instruct"
    assert (flags["--dtype"], flags["--max-model-len"], flags["--max-num-seqs"]) == ("bfloat16", "8192", "256")
    assert (flags["--max-num-batched-tokens"], flags["--block-size"]) == ("8192", "16")
    assert flags["--gpu-memory-utilization"] == "0.9" and flags["--port"] == "8000"
    assert flags["--metrics-port"] == "9400"  # /metrics off the API port
    assert "--enforce-eager" not in args  # cudaGraphs: true
    assert flags["--tenants"] == "/etc/sits/tenants.yaml"  # the ConfigMap's file
    assert (flags["--state-store"], flags["--deployment"]) == ("redis://sits-redis:6379/0", "llm.llama3-8b")
    eager = parse_spec({**EXAMPLE["spec"], "engine": {"cudaGraphs": False}, "gpusPerReplica": 0}, "x").workload
    args = container(objects(plan=Plan(TrackPlan(eager, "r", 1), TrackPlan(eager, "r", 0)))[("Deployment", "llama3-8b-stable")])["args"]
    assert "--enforce-eager" in args and args[args.index("--device") + 1] == "cpu"


def stable_container(spec):
    plan = Plan(TrackPlan(spec.workload, "r", 1), TrackPlan(spec.workload, "r", 0))
    return container(objects(spec, plan)[("Deployment", "llama3-8b-stable")])


def test_tracing_passes_the_otlp_endpoint_to_the_runtime():
    endpoint = "http://otel-collector.monitoring:4318"
    traced = parse_spec({**EXAMPLE["spec"], "tracing": {"otlpEndpoint": endpoint}}, "llama3-8b")
    args = stable_container(traced)["args"]
    assert args[args.index("--otlp-endpoint") + 1] == endpoint
    assert build_parser().parse_args(serve_args(args)).otlp_endpoint == endpoint  # a flag `sits serve` takes
    for untraced in (SPEC, parse_spec({**EXAMPLE["spec"], "tracing": {}}, "llama3-8b")):
        assert "--otlp-endpoint" not in stable_container(untraced)["args"]
    assert revision_of(OWNER, traced.workload) != REVISION  # turning tracing on rolls out as a canary
    assert parse_workload(traced.workload.to_dict(), "status.stableSpec") == traced.workload


def test_an_hf_model_reaches_the_runtime_as_its_uri_with_a_cache_that_outlives_restarts():
    uri = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"
    spec = parse_spec({**EXAMPLE["spec"], "model": {"name": "smollm2", "uri": uri}}, "llama3-8b")
    plan = Plan(TrackPlan(spec.workload, "r", 1), TrackPlan(spec.workload, "r", 0))
    deployment = objects(spec, plan)[("Deployment", "llama3-8b-stable")]
    main, pod = container(deployment), deployment["spec"]["template"]["spec"]
    args = main["args"]
    assert args[args.index("--model") + 1] == uri and build_parser().parse_args(serve_args(args)).model == uri
    assert {"name": "HF_HOME", "value": "/var/cache/huggingface"} in main["env"]
    assert {"name": "hf-cache", "emptyDir": {}} in pod["volumes"]
    assert {"name": "hf-cache", "mountPath": "/var/cache/huggingface"} in main["volumeMounts"]
    assert "model" not in {v["name"] for v in pod["volumes"]}  # no PVC to mount
    kubernetes_validate.validate(deployment, "1.33", strict=True)
    pvc_pod = objects()[("Deployment", "llama3-8b-stable")]["spec"]["template"]["spec"]  # pvc://models/llama-3-8b
    assert "hf-cache" not in {v["name"] for v in pvc_pod["volumes"]}
    assert "HF_HOME" not in {e["name"] for e in pvc_pod["containers"][0]["env"]}


def test_nccl_env_in_the_spec_overrides_the_defaults():
    spec = parse_spec({**EXAMPLE["spec"], "nccl": {"env": {"NCCL_SOCKET_NTHREADS": "2"}}}, "x")
    plan = Plan(TrackPlan(spec.workload, "r", 1), TrackPlan(spec.workload, "r", 0))
    env = container(objects(spec, plan)[("Deployment", "llama3-8b-stable")])["env"]
    assert [e["value"] for e in env if e["name"] == "NCCL_SOCKET_NTHREADS"] == ["2"]


def test_services_select_each_track_and_both():
    built = objects()
    selectors = {name: obj["spec"]["selector"] for (kind, name), obj in built.items() if kind == "Service"}
    assert selectors == {"llama3-8b": {"sits.ai/deployment": "llama3-8b"},
                         "llama3-8b-stable": {"sits.ai/deployment": "llama3-8b", "track": "stable"},
                         "llama3-8b-canary": {"sits.ai/deployment": "llama3-8b", "track": "canary"}}
    ports = {name: [(p["name"], p["port"], p["targetPort"]) for p in obj["spec"]["ports"]]
             for (kind, name), obj in built.items() if kind == "Service"}
    # the metrics port only on the per-track Services the ServiceMonitor scrapes; routes use port 80
    assert ports == {"llama3-8b": [("http", 80, "http")],
                     "llama3-8b-stable": [("http", 80, "http"), ("metrics", 9400, "metrics")],
                     "llama3-8b-canary": [("http", 80, "http"), ("metrics", 9400, "metrics")]}


def test_http_route_weights_and_tenant_scoped_canary():
    route = objects()[("HTTPRoute", "llama3-8b")]
    tenant_rule, default_rule = route["spec"]["rules"]
    assert tenant_rule["matches"] == [{"headers": [{"type": "Exact", "name": "x-sits-tenant", "value": "beta"}]}]
    assert [(b["name"], b["weight"]) for b in tenant_rule["backendRefs"]] == [("llama3-8b-canary", 100)]
    assert [(b["name"], b["weight"]) for b in default_rule["backendRefs"]] == [
        ("llama3-8b-stable", 90), ("llama3-8b-canary", 10)]
    idle = Plan(TrackPlan(SPEC.workload, REVISION, 2), TrackPlan(SPEC.workload, REVISION, 0))
    (rule,) = objects(plan=idle)[("HTTPRoute", "llama3-8b")]["spec"]["rules"]
    assert [(b["name"], b["weight"]) for b in rule["backendRefs"]] == [("llama3-8b-stable", 100), ("llama3-8b-canary", 0)]


def test_monitoring_objects_follow_the_spec():
    built = objects()
    monitor = built[("ServiceMonitor", "llama3-8b")]["spec"]
    assert monitor["selector"]["matchExpressions"] == [{"key": "sits.ai/service", "operator": "In",
                                                        "values": ["stable", "canary"]}]
    assert monitor["endpoints"][0]["relabelings"][0]["targetLabel"] == "sitsdeployment"
    assert (monitor["endpoints"][0]["port"], monitor["endpoints"][0]["path"]) == ("metrics", "/metrics")
    (rule,) = built[("PrometheusRule", "llama3-8b")]["spec"]["groups"][0]["rules"]
    assert rule["alert"] == ALERT_NAME and rule["for"] == "1m"
    assert rule["labels"] == {"severity": "warning", "namespace": "llm", "sitsdeployment": "llama3-8b"}
    assert rule["expr"].endswith("> 0.05") and 'track="canary"' in rule["expr"] and 'track="stable"' in rule["expr"]
    quiet = parse_spec({**EXAMPLE["spec"], "monitoring": {}}, "llama3-8b")
    kinds = {kind for kind, _ in objects(quiet)}
    assert "ServiceMonitor" not in kinds and "PrometheusRule" not in kinds
    assert ("HTTPRoute", "llama3-8b") not in objects(parse_spec({**EXAMPLE["spec"], "rollout": {}}, "llama3-8b"))


def test_pod_disruption_budget():
    pdb = objects()[("PodDisruptionBudget", "llama3-8b")]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"sits.ai/deployment": "llama3-8b"}}}


def test_config_map_holds_engine_config_and_only_key_digests():
    secret = {"token": base64.b64encode(KEY.encode()).decode()}
    resolution = resolve_tenants(SPEC.tenancy, lambda name: secret if name == "finance-key" else None)
    assert resolution.problems == []
    config_map = objects(tenants=resolution.records)[("ConfigMap", "llama3-8b-engine")]
    text = yaml.safe_dump(config_map)
    assert KEY not in text and base64.b64encode(KEY.encode()).decode() not in text
    tenants = yaml.safe_load(config_map["data"]["tenants.yaml"])["tenants"]
    assert tenants == [{"name": "finance", "apiKeySha256": hashlib.sha256(KEY.encode()).hexdigest(), "priority": 3,
                        "kvCacheShare": 0.4, "requestsPerMinute": 600, "tokensPerMinute": 200000}]
    stable = yaml.safe_load(config_map["data"]["engine-stable.yaml"])
    assert stable["revision"] == REVISION and stable["engine"]["maxNumBatchedTokens"] == 8192
    assert "engine-canary.yaml" in config_map["data"]
    assert KEY not in repr(resolution)


def test_missing_secrets_are_reported_not_raised():
    resolution = resolve_tenants(SPEC.tenancy, lambda name: None)
    assert resolution.records == []
    assert resolution.problems == ["tenant finance: Secret finance-key not found"]
    resolution = resolve_tenants(SPEC.tenancy, lambda name: {"other": "eA=="})
    assert resolution.problems == ["tenant finance: Secret finance-key has no key 'token'"]


def test_building_is_deterministic():
    assert build_all(OWNER, SPEC, CANARY_PLAN, None) == build_all(OWNER, SPEC, CANARY_PLAN, None)
