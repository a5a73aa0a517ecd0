"""The SitsDeployment spec as validated, frozen dataclasses.

`parse_spec(spec, name)` is the one entry point: it applies the same defaults as the CRD (so a
resource created where the API server did not default it behaves the same) and raises `SpecError`
naming the field path. The pod-template part of the spec is `WorkloadSpec`; it round-trips through
`to_dict()` / `parse_workload()` because the stable track's copy lives in `status.stableSpec`
while a canary runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sits.operator.fields import Fields, SpecError, spec_field
from sits.operator.spec_autoscaling import AutoscalingSpec, parse_autoscaling
from sits.operator.spec_lora import ENGINE_FIELDS as LORA_ENGINE_FIELDS
from sits.operator.spec_lora import MODEL_URI, MODEL_URI_FORM, LoraSpec, parse_lora
from sits.operator.spec_rollout import HTTP_URL, MonitoringSpec, RolloutSpec, parse_monitoring, parse_rollout
from sits.operator.spec_router import FIELDS as ROUTER_FIELDS
from sits.operator.spec_router import RouterSpec, check_router_model, parse_router
from sits.runtime.tenancy.tenants_schema import MODEL_ID_RULE, TENANT_NAME, ModelIdsError, model_ids

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "fp8", "int8")
KV_CACHE_DTYPES = ("auto", "fp8")  # the runtime also takes vLLM's "fp8_e4m3"; the CRD has one spelling
KV_CACHE_SCALES = ("static", "calibrate")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
REDIS_URL = re.compile(r"^(redis|rediss|unix)://\S+$")

__all__ = ["SpecError", "SitsDeploymentSpec", "WorkloadSpec", "parse_spec", "parse_workload"]


@dataclass(frozen=True)
class ModelSpec:
    """Which checkpoint, how. `uri`: pvc://claim/path, hf://org/name[@revision] (the runtime downloads it)
    or file:///path in the image."""

    name: str
    uri: str
    dtype: str = "auto"
    quantization: str = "none"
    max_model_len: int | None = None


@dataclass(frozen=True)
class EngineSpec:
    """Engine limits (the runtime's flags); tokens and sequences per engine step."""

    max_num_seqs: int = spec_field("maxNumSeqs", "integer", 256, minimum=1)
    max_num_batched_tokens: int = spec_field("maxNumBatchedTokens", "integer", 2048, minimum=1)
    gpu_memory_utilization: float = spec_field("gpuMemoryUtilization", "number", 0.9, minimum=0.0, maximum=1.0,
                                               exclusive_minimum=True)
    kv_block_size: int = 16  # kvBlockSize, one of BLOCK_SIZES
    cuda_graphs: bool = spec_field("cudaGraphs", "boolean", True)
    # host-memory tier for evicted prefix-cache blocks, GiB (0: off)
    host_kv_cache_gb: float = spec_field("hostKvCacheGb", "number", 0.0, minimum=0.0, maximum=65536.0)
    # the paged KV cache's storage: "auto" (the model's dtype) or "fp8" (e4m3, per-head scales: twice the blocks)
    kv_cache_dtype: str = spec_field("kvCacheDtype", "string", "auto", choices=KV_CACHE_DTYPES)
    # an fp8 cache's scales: "static" (1.0) or "calibrate" (measured at start-up; one GPU per replica)
    kv_cache_scales: str = spec_field("kvCacheScales", "string", "static", choices=KV_CACHE_SCALES)

    def fp8_engine_dict(self) -> dict[str, str]:
        """The fp8-cache keys of the stored spec, only when set: a spec without them keeps its revision."""
        return {**({"kvCacheDtype": self.kv_cache_dtype} if self.kv_cache_dtype != "auto" else {}),
                **({"kvCacheScales": self.kv_cache_scales} if self.kv_cache_scales != "static" else {})}


@dataclass(frozen=True)
class NcclSpec:
    socket_nthreads: int = 8
    min_channels: int = 4
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that shapes the pod template; a change here is a new revision (a canary)."""

    model: ModelSpec
    image: str
    image_pull_policy: str | None = None
    gpus_per_replica: int = 1
    gpu_product: str | None = None
    resources: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    engine: EngineSpec = field(default_factory=EngineSpec)
    nccl: NcclSpec = field(default_factory=NcclSpec)
    redis_url: str | None = None
    tenants_file: bool = False  # serve with the tenants file of the ConfigMap
    otlp_endpoint: str | None = None  # request traces to this OTLP/HTTP collector (spec.tracing)
    lora: LoraSpec = field(default_factory=LoraSpec)  # spec.model.loraAdapters, spec.engine.maxLoras/maxLoraRank

    def to_dict(self) -> dict[str, Any]:
        """The spec-shaped dict `parse_workload` reads back (kept in status.stableSpec)."""
        model: dict[str, Any] = {"name": self.model.name, "uri": self.model.uri, "dtype": self.model.dtype,
                                 "quantization": self.model.quantization}
        if self.model.max_model_len is not None:
            model["maxModelLen"] = self.model.max_model_len
        model.update(self.lora.model_dict())
        data: dict[str, Any] = {
            "model": model, "image": self.image, "gpusPerReplica": self.gpus_per_replica,
            "engine": {"maxNumSeqs": self.engine.max_num_seqs,
                       "maxNumBatchedTokens": self.engine.max_num_batched_tokens,
                       "gpuMemoryUtilization": self.engine.gpu_memory_utilization,
                       "kvBlockSize": self.engine.kv_block_size, "cudaGraphs": self.engine.cuda_graphs,
                       **self.lora.engine_dict(),
                       # only when set: a spec without the tier keeps its stored form (and revision)
                       **({"hostKvCacheGb": self.engine.host_kv_cache_gb} if self.engine.host_kv_cache_gb else {}),
                       **self.engine.fp8_engine_dict()},
            "nccl": {"socketNThreads": self.nccl.socket_nthreads, "minChannels": self.nccl.min_channels,
                     "env": dict(self.nccl.env)},
            "tenantsFile": self.tenants_file,
        }
        if self.image_pull_policy:
            data["imagePullPolicy"] = self.image_pull_policy
        if self.gpu_product:
            data["gpuProduct"] = self.gpu_product
        if self.resources:
            data["resources"] = {kind: dict(values) for kind, values in self.resources}
        if self.redis_url:
            data["tenancy"] = {"redis": {"url": self.redis_url}}
        if self.otlp_endpoint:
            data["tracing"] = {"otlpEndpoint": self.otlp_endpoint}
        return data


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the resource's namespace (the tenant's API key)."""

    name: str = spec_field("name", "string", pattern=RESOURCE_NAME, what="a Secret name")
    key: str = spec_field("key", "string")


@dataclass(frozen=True)
class TenantSpec:
    """One tenant; its API key is read from the Secret and only its SHA-256 ever leaves the operator."""

    name: str
    api_key_secret_ref: SecretKeyRef
    priority: int = 0
    kv_cache_share: float = 0.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    models: tuple[str, ...] | None = None  # model ids (base name, adapter names) it may use; None: all
    host_kv_cache_share: float = 0.0  # guaranteed fraction of the host KV tier


@dataclass(frozen=True)
class TenancySpec:
    redis_url: str | None = None
    tenants: tuple[TenantSpec, ...] = ()


@dataclass(frozen=True)
class SitsDeploymentSpec:
    name: str
    workload: WorkloadSpec
    replicas: int = 1
    tenancy: TenancySpec = field(default_factory=TenancySpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    monitoring: MonitoringSpec = field(default_factory=MonitoringSpec)
    autoscaling: AutoscalingSpec | None = None  # a HorizontalPodAutoscaler writes `replicas`
    router: RouterSpec = field(default_factory=RouterSpec)  # spec.router: `sits router` in front


_SPEC_FIELDS = {"model", "image", "imagePullPolicy", "replicas", "gpusPerReplica", "gpuProduct", "resources",
                "engine", "nccl", "tenancy", "rollout", "monitoring", "tracing", "autoscaling", "router"}
_AUTOSCALING_FIELDS = {"minReplicas", "maxReplicas", "metrics", "behavior"}


def parse_spec(spec: Any, name: str) -> SitsDeploymentSpec:
    """Validate a SitsDeployment's spec; raises SpecError naming the first invalid field."""
    fields = Fields(spec, "spec", _SPEC_FIELDS)
    tenancy = _parse_tenancy(fields.child("tenancy", {"redis", "tenants"}))
    workload = parse_workload(spec, "spec", default_model_name=name, tenants_file=bool(tenancy.tenants))
    rollout = parse_rollout(fields.child("rollout", {"canary", "trafficRouting"}))
    router = parse_router(fields.child("router", ROUTER_FIELDS))
    check_router_model(router, workload.model.uri)
    if rollout.canary.tenants and rollout.gateway_api is None and not router.enabled:
        raise SpecError("spec.rollout.canary.tenants",
                        "routing tenants to the canary needs spec.rollout.trafficRouting.gatewayAPI "
                        "(a header match) or spec.router.enabled (the router routes them); without "
                        "either, traffic is split by replica ratio only")
    autoscaling = parse_autoscaling(fields.child("autoscaling", _AUTOSCALING_FIELDS),
                                    cpu_requested=any(kind == "requests" and "cpu" in dict(values)
                                                      for kind, values in workload.resources))
    replicas = fields.integer("replicas", 1, minimum=0)
    if autoscaling is not None:
        # The HPA keeps spec.replicas within its bounds; until its first sync the operator does the same
        replicas = autoscaling.clamp(replicas)
    return SitsDeploymentSpec(
        name=name, workload=workload, replicas=replicas,
        tenancy=tenancy, rollout=rollout,
        monitoring=parse_monitoring(fields.child("monitoring", {"serviceMonitor", "prometheusRule"})),
        autoscaling=autoscaling, router=router,
    )


def parse_workload(data: Any, path: str, *, default_model_name: str | None = None,
                   tenants_file: bool | None = None) -> WorkloadSpec:
    """The pod-template part of a spec-shaped dict (a spec, or status.stableSpec)."""
    fields = Fields(data, path)
    model_fields = fields.child("model", {"name", "uri", "dtype", "quantization", "maxModelLen", "loraAdapters"},
                                required=True)
    assert model_fields is not None  # required=True raised otherwise
    model = ModelSpec(
        name=model_fields.string("name", default_model_name, required=default_model_name is None),
        uri=model_fields.string("uri", required=True, pattern=MODEL_URI, what=MODEL_URI_FORM),
        dtype=model_fields.string("dtype", "auto", choices=DTYPES),
        quantization=model_fields.string("quantization", "none", choices=QUANTIZATIONS),
        max_model_len=model_fields.integer("maxModelLen", None, minimum=1),
    )
    engine_fields = fields.child("engine", {"maxNumSeqs", "maxNumBatchedTokens", "gpuMemoryUtilization",
                                            "kvBlockSize", "cudaGraphs", "hostKvCacheGb", "kvCacheDtype",
                                            "kvCacheScales", *LORA_ENGINE_FIELDS}) or Fields({}, fields.at("engine"))
    block_size = engine_fields.integer("kvBlockSize", 16)
    if block_size not in BLOCK_SIZES:
        raise SpecError(engine_fields.at("kvBlockSize"), f"must be a power of two up to 256, got {block_size}")
    engine = engine_fields.parse_into(EngineSpec, kv_block_size=block_size)
    if engine.kv_cache_scales != "static" and engine.kv_cache_dtype != "fp8":
        raise SpecError(engine_fields.at("kvCacheScales"), "applies to an fp8 cache only: set kvCacheDtype: fp8")
    nccl_fields = fields.child("nccl", {"socketNThreads", "minChannels", "env"}) or Fields({}, fields.at("nccl"))
    nccl = NcclSpec(
        socket_nthreads=nccl_fields.integer("socketNThreads", 8, minimum=1),
        min_channels=nccl_fields.integer("minChannels", 4, minimum=1),
        env=tuple(sorted(nccl_fields.string_map("env", ENV_NAME, "an environment variable name").items())),
    )
    tenancy = fields.child("tenancy")
    redis = tenancy.child("redis", {"url"}) if tenancy is not None else None
    tracing = fields.child("tracing", {"otlpEndpoint"})
    if tenants_file is None:
        tenants_file = fields.boolean("tenantsFile", False)
    gpus_per_replica = fields.integer("gpusPerReplica", 1, minimum=0)
    assert gpus_per_replica is not None  # a default
    if engine.kv_cache_scales == "calibrate" and gpus_per_replica > 1:
        raise SpecError(engine_fields.at("kvCacheScales"), "calibrate runs with one GPU per replica only "
                        f"(gpusPerReplica is {gpus_per_replica}); use static")
    lora = parse_lora(model_fields, engine_fields, model_name=str(model.name),
                      quantization=model.quantization or "none", gpus_per_replica=gpus_per_replica)
    return WorkloadSpec(
        model=model,
        image=fields.string("image", required=True),
        image_pull_policy=fields.string("imagePullPolicy", None, choices=PULL_POLICIES),
        gpus_per_replica=gpus_per_replica,
        gpu_product=fields.string("gpuProduct", None),
        resources=_parse_resources(fields.child("resources", {"requests", "limits"})),
        engine=engine, nccl=nccl,
        redis_url=redis.string("url", None, pattern=REDIS_URL, what="redis://host:port/db") if redis else None,
        tenants_file=tenants_file,
        otlp_endpoint=tracing.string("otlpEndpoint", None, pattern=HTTP_URL,
                                     what="an http(s):// URL of an OTLP/HTTP collector") if tracing else None,
        lora=lora,
    )


def _parse_resources(fields: Fields | None) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    if fields is None:
        return ()
    result = []
    for kind in ("requests", "limits"):
        values = fields.child(kind)
        if values is None:
            continue
        quantities = []
        for resource, quantity in values.data.items():
            if isinstance(quantity, bool) or not isinstance(quantity, str | int | float):
                raise SpecError(values.at(str(resource)), f"must be a quantity such as 4 or 16Gi, got {quantity!r}")
            quantities.append((str(resource), str(quantity)))
        result.append((kind, tuple(sorted(quantities))))
    return tuple(result)


def _parse_tenancy(fields: Fields | None) -> TenancySpec:
    if fields is None:
        return TenancySpec()
    redis = fields.child("redis", {"url"})
    tenants = []
    for path, item in fields.items("tenants"):
        tenant = Fields(item, path, {"name", "priority", "kvCacheShare", "hostKvCacheShare", "apiKeySecretRef",
                                     "limits", "models"})
        ref = tenant.child("apiKeySecretRef", {"name", "key"}, required=True)
        assert ref is not None
        limits = tenant.child("limits", {"requestsPerMinute", "tokensPerMinute"}) or Fields({}, tenant.at("limits"))
        tenants.append(TenantSpec(
            name=tenant.string("name", required=True, pattern=TENANT_NAME,
                               what="letters, digits, '.', '_' or '-' (at most 63)"),
            api_key_secret_ref=ref.parse_into(SecretKeyRef),
            priority=tenant.integer("priority", 0, minimum=0, maximum=3),
            kv_cache_share=tenant.number("kvCacheShare", 0.0, minimum=0.0, maximum=1.0),
            requests_per_minute=limits.integer("requestsPerMinute", None, minimum=1),
            tokens_per_minute=limits.integer("tokensPerMinute", None, minimum=1),
            models=_model_ids(tenant),
            host_kv_cache_share=tenant.number("hostKvCacheShare", 0.0, minimum=0.0, maximum=1.0),
        ))
    seen: set[str] = set()
    for index, parsed in enumerate(tenants):
        if parsed.name in seen:
            raise SpecError(f"spec.tenancy.tenants[{index}].name", f"tenant {parsed.name!r} appears twice")
        seen.add(parsed.name)
    total = sum(t.kv_cache_share for t in tenants)
    if total > 1.0 + 1e-9:
        raise SpecError("spec.tenancy.tenants", f"kvCacheShare values sum to {total:g}, more than 1")
    host_total = sum(t.host_kv_cache_share for t in tenants)
    if host_total > 1.0 + 1e-9:
        raise SpecError("spec.tenancy.tenants", f"hostKvCacheShare values sum to {host_total:g}, more than 1")
    return TenancySpec(
        redis_url=redis.string("url", None, pattern=REDIS_URL, what="redis://host:port/db") if redis else None,
        tenants=tuple(tenants),
    )


def _model_ids(tenant: Fields) -> tuple[str, ...] | None:
    """A tenant's `models` allow-list (`tenants_schema.model_ids`), its problems named by spec path."""
    if tenant.data.get("models") is None:
        return None
    items = tenant.items("models")  # a SpecError unless it is a list
    try:
        return model_ids([item for _, item in items])
    except ModelIdsError as error:
        if error.index is None:
            raise SpecError(tenant.at("models"),
                            "must list at least one model id (leave it out to allow every model)") from None
        path = items[error.index][0]
        if error.repeated:
            raise SpecError(path, f"{error.value!r} is listed twice") from None
        raise SpecError(path, f"must be a model id ({MODEL_ID_RULE}), got {error.value!r}") from None
