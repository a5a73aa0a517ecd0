"""The parsed spec: defaults, the DESIGN.md example, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sits.operator.fields import SpecError, format_duration, parse_duration
from sits.operator.spec import parse_spec, parse_workload

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sitsdeployment.yaml"
MINIMAL = {"model": {"uri": "hf://org/tiny"}, "image": "sits:1"}


def with_field(path: str, value):
    """MINIMAL with `value` set at a dotted path (lists as [index])."""
    spec = yaml.safe_load(yaml.safe_dump(MINIMAL))
    parts = path.split(".")
    node = spec
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return spec


def test_design_example_parses_with_its_values():
    body = yaml.safe_load(EXAMPLE.read_text())
    spec = parse_spec(body["spec"], body["metadata"]["name"])
    assert spec.replicas == 2
    assert spec.workload.model.name == "llama-3-8b-instruct"
    assert spec.workload.gpu_product == "NVIDIA-H100-80GB-HBM3"
    assert spec.workload.engine.max_num_batched_tokens == 8192
    assert dict(spec.workload.nccl.env) == {"NCCL_IB_DISABLE": "0"}
    assert [s.set_weight for s in spec.rollout.canary.steps] == [10, None, 50, None]
    assert [s.pause_seconds for s in spec.rollout.canary.steps] == [None, 300.0, None, 600.0]
    analysis = spec.rollout.canary.analysis
    assert (analysis.max_delta_ms, analysis.interval_s, analysis.failure_limit) == (50.0, 60.0, 2)
    assert spec.rollout.gateway_api.http_route == "llama3-8b"
    assert spec.tenancy.tenants[0].api_key_secret_ref.name == "finance-key"
    assert spec.monitoring.service_monitor and spec.monitoring.prometheus_rule


def test_minimal_spec_takes_the_defaults():
    spec = parse_spec(MINIMAL, "demo")
    assert spec.workload.model.name == "demo"  # the resource's name is the model id by default
    assert (spec.replicas, spec.workload.gpus_per_replica) == (1, 1)
    assert (spec.workload.nccl.socket_nthreads, spec.workload.nccl.min_channels) == (8, 4)
    assert spec.workload.engine.kv_block_size == 16 and spec.workload.engine.cuda_graphs
    assert spec.rollout.canary.steps == () and spec.rollout.canary.analysis is None
    assert spec.rollout.gateway_api is None
    assert not spec.monitoring.service_monitor and not spec.workload.tenants_file


@pytest.mark.parametrize(("path", "value", "field", "words"), [
    ("image", None, "spec.image", "required"),
    ("replicas", -1, "spec.replicas", ">= 0"),
    ("replicas", "2", "spec.replicas", "integer"),
    ("model", {"uri": "s3://bucket/x"}, "spec.model.uri", "pvc://"),
    ("model", {"uri": "hf://a/b", "dtype": "fp64"}, "spec.model.dtype", "one of"),
    ("engine", {"kvBlockSize": 24}, "spec.engine.kvBlockSize", "power of two"),
    ("engine", {"gpuMemoryUtilization": 0}, "spec.engine.gpuMemoryUtilization", "> 0"),
    ("engine", {"maxNumSeq": 8}, "spec.engine.maxNumSeq", "did you mean maxNumSeqs"),
    ("nccl", {"env": {"NCCL_IB_DISABLE": 0}}, "spec.nccl.env.NCCL_IB_DISABLE", "quote it"),
    ("rollout", {"canary": {"steps": [{"setWeight": 150}]}}, "spec.rollout.canary.steps[0].setWeight", "<= 100"),
    ("rollout", {"canary": {"steps": [{"setWeight": 10, "pause": {}}]}}, "spec.rollout.canary.steps[0]",
     "exactly one"),
    ("rollout", {"canary": {"steps": [{"pause": {"duration": "5 minutes"}}]}},
     "spec.rollout.canary.steps[0].pause.duration", "duration"),
    ("rollout", {"canary": {"analysis": {"prometheus": {"url": "http://p:9090"}}}},
     "spec.rollout.canary.analysis.maxDeltaMs", "required"),
    ("rollout", {"canary": {"analysis": {"prometheus": {"url": "p:9090"}, "maxDeltaMs": 5}}},
     "spec.rollout.canary.analysis.prometheus.url", "http"),
    ("rollout", {"canary": {"analysis": {"prometheus": {"url": "http://p"}, "maxDeltaMs": 5, "failureLimit": 0}}},
     "spec.rollout.canary.analysis.failureLimit", ">= 1"),
    ("rollout", {"canary": {"tenants": ["beta"]}}, "spec.rollout.canary.tenants", "gatewayAPI"),
    ("rollout", {"trafficRouting": {"gatewayAPI": {"httpRoute": "Bad_Name"}}},
     "spec.rollout.trafficRouting.gatewayAPI.httpRoute", "HTTPRoute name"),
    ("tenancy", {"tenants": [{"name": "a", "kvCacheShare": 0.7, "apiKeySecretRef": {"name": "k", "key": "t"}},
                             {"name": "b", "kvCacheShare": 0.6, "apiKeySecretRef": {"name": "k", "key": "t"}}]},
     "spec.tenancy.tenants", "sum to 1.3"),
    ("tenancy", {"tenants": [{"name": "a", "apiKeySecretRef": {"name": "k", "key": "t"}},
                             {"name": "a", "apiKeySecretRef": {"name": "k", "key": "t"}}]},
     "spec.tenancy.tenants[1].name", "twice"),
    ("tenancy", {"tenants": [{"name": "a", "priority": 4, "apiKeySecretRef": {"name": "k", "key": "t"}}]},
     "spec.tenancy.tenants[0].priority", "<= 3"),
    ("tenancy", {"tenants": [{"name": "a"}]}, "spec.tenancy.tenants[0].apiKeySecretRef", "required"),
    ("monitoring", {"serviceMonitor": "yes"}, "spec.monitoring.serviceMonitor", "true or false"),
    ("tracing", {"otlpEndpoint": "otel-collector:4318"}, "spec.tracing.otlpEndpoint", "http(s)://"),
    ("tracing", {"endpoint": "http://otel:4318"}, "spec.tracing.endpoint", "did you mean otlpEndpoint"),
    ("colour", "blue", "spec.colour", "unknown field"),
])
def test_invalid_fields_are_named(path, value, field, words):
    with pytest.raises(SpecError) as raised:
        parse_spec(with_field(path, value), "demo")
    assert raised.value.path == field
    assert words in str(raised.value)


def test_spec_must_be_an_object():
    with pytest.raises(SpecError, match="spec: must be an object"):
        parse_spec(["not", "a", "mapping"], "demo")


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("1h30m", 5400.0), ("250ms", 0.25), ("1.5s", 1.5), (45, 45.0),
])
def test_durations(text, seconds):
    assert parse_duration(text, "x") == seconds


@pytest.mark.parametrize("text", ["5 m", "m5", "", "5d", True, "-5s"])
def test_bad_durations(text):
    with pytest.raises(SpecError):
        parse_duration(text, "spec.x")


def test_duration_formatting_for_promql():
    assert [format_duration(s) for s in (300, 3600, 90, 0.2)] == ["5m", "1h", "90s", "1s"]


def test_workload_round_trips_through_status():
    body = yaml.safe_load(EXAMPLE.read_text())
    workload = parse_spec(body["spec"], "llama3-8b").workload
    assert parse_workload(workload.to_dict(), "status.stableSpec") == workload
