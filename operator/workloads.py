"""Pure builders of the pods' side: the engine ConfigMap, the pod template and the track Deployments."""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from sits.operator.lora_workloads import build_lora_volumes, lora_args, lora_downloads_from_hub
from sits.operator.meta import (
    DEPLOYMENT_LABEL,
    HTTP_PORT,
    METRICS_PORT,
    REVISION_ANNOTATION,
    REVISION_LABEL,
    TRACK_LABEL,
    Owner,
    common_labels,
    config_map_name,
    deployment_id,
    deployment_name,
    object_meta,
)
from sits.operator.plan import Plan, TrackPlan
from sits.operator.spec import WorkloadSpec
from sits.operator.tenants import TenantRecord
from sits.runtime.tenancy.tenants_schema import tenants_document

CONFIG_DIR = "/etc/sits"
TENANTS_FILE = f"{CONFIG_DIR}/tenants.yaml"
MODEL_DIR = "/mnt/models"
HF_CACHE_DIR = "/var/cache/huggingface"  # HF_HOME of pods serving hf:// models (an emptyDir)
RUNTIME_UID = 10001  # the runtime image's unprivileged user (Dockerfile)
RUNTIME_HOME = "/home/sits"  # its HOME: GGUF conversion, Triton and torch.compile caches (an emptyDir)
# The runtime's root filesystem is read-only; these emptyDirs are all it writes to besides the model caches.
WRITABLE_DIRS = (("tmp", "/tmp"), ("home", RUNTIME_HOME))
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUNTIME_UID, "runAsGroup": RUNTIME_UID, "fsGroup": RUNTIME_UID,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DRAIN_SECONDS = 45  # > the runtime's default 30 s drain, so in-flight requests finish on SIGTERM


def engine_args(workload: WorkloadSpec, deployment: str) -> list[str]:
    """`sits serve` flags for this workload (the track flag is added per Deployment).

    `deployment` (`{namespace}.{name}`) names the tenancy state in a shared Redis
    (`sits:{deployment}:...`), where the operator writes the tenant table.
    """
    model, engine = workload.model, workload.engine
    args = ["serve", "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--metrics-port", str(METRICS_PORT),
            "--model", _model_path(model.uri), "--served-model-name", model.name,
            "--dtype", model.dtype, "--quantization", model.quantization,
            "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--block-size", str(engine.kv_block_size),
            "--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if workload.gpus_per_replica == 0:
        args += ["--device", "cpu"]
    elif workload.gpus_per_replica > 1:
        args += ["--tensor-parallel-size", str(workload.gpus_per_replica)]
    if not engine.cuda_graphs:
        args.append("--enforce-eager")
    if engine.host_kv_cache_gb > 0:
        args += ["--host-kv-cache-gb", f"{engine.host_kv_cache_gb:g}"]
    if engine.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", engine.kv_cache_dtype, "--kv-cache-scales", engine.kv_cache_scales]
    if workload.tenants_file:
        args += ["--tenants", TENANTS_FILE]
    if workload.redis_url:
        args += ["--state-store", workload.redis_url, "--deployment", deployment]
    if workload.otlp_endpoint:
        args += ["--otlp-endpoint", workload.otlp_endpoint]
    return args + lora_args(workload.lora)


def _model_path(uri: str) -> str:
    scheme, _, rest = uri.partition("://")
    if scheme == "pvc":
        _claim, _, path = rest.partition("/")
        return f"{MODEL_DIR}/{path}".rstrip("/")
    if scheme == "hf":
        return uri  # the runtime downloads it (huggingface_hub) into HF_HOME at start
    return rest  # file:///path -> /path inside the image


def _downloads_from_hub(workload: WorkloadSpec) -> bool:
    """The base model or an adapter is an hf:// repository, fetched into HF_HOME when the pod starts."""
    return workload.model.uri.startswith("hf://") or lora_downloads_from_hub(workload.lora)


def _env(workload: WorkloadSpec) -> list[dict[str, Any]]:
    values = {"NCCL_SOCKET_NTHREADS": str(workload.nccl.socket_nthreads),
              "NCCL_MIN_NCHANNELS": str(workload.nccl.min_channels),
              "HOME": RUNTIME_HOME}  # the writable emptyDir, whatever the image's own HOME
    if _downloads_from_hub(workload):
        values["HF_HOME"] = HF_CACHE_DIR
    values.update(dict(workload.nccl.env))  # the spec's own variables win over the defaults
    return [{"name": key, "value": values[key]} for key in sorted(values)]


def _resources(workload: WorkloadSpec) -> dict[str, Any]:
    resources: dict[str, dict[str, str]] = {kind: dict(values) for kind, values in workload.resources}
    if workload.gpus_per_replica > 0:
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(workload.gpus_per_replica)
    host_tier = int(math.ceil(workload.engine.host_kv_cache_gb * 1024))  # MiB of the host KV tier
    if host_tier > 0:  # pinned host memory counts against the pod's memory: request (and limit) it too
        for kind in ("requests", "limits"):
            current = resources.get(kind, {}).get("memory")
            if kind == "requests" or current is not None:
                try:
                    base = memory_mib(current) if current is not None else 0
                except ValueError:
                    continue  # not a quantity: left as written, for the API server to reject
                resources.setdefault(kind, {})["memory"] = f"{base + host_tier}Mi"
    return resources


_MEMORY_UNITS = {"": 1, "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4, "P": 1000**5, "E": 1000**6,
                 "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}


def memory_mib(quantity: str) -> int:
    """A Kubernetes memory quantity ("16Gi", "512M", "1e9", "1073741824") in MiB, rounded up."""
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|)\s*", str(quantity))
    if match is None:
        raise ValueError(f"not a memory quantity: {quantity!r}")
    return int(math.ceil(float(match.group(1)) * _MEMORY_UNITS[match.group(2)] / (1 << 20)))


def _probe(path: str, period_s: int, timeout_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s,
            "timeoutSeconds": timeout_s, "failureThreshold": failures}


def build_pod_template(owner: Owner, workload: WorkloadSpec, track: str | None = None,
                       revision: str | None = None) -> dict[str, Any]:
    """The pod template of one track; with track None, the track-neutral template revisions hash."""
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL and torch workers share memory here
        {"name": "config", "configMap": {"name": config_map_name(owner.name)}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"},
                                    {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    extra_volumes, extra_mounts = writable_and_model_volumes(workload.model.uri)
    volumes += extra_volumes
    mounts += extra_mounts
    lora_volumes, lora_mounts = build_lora_volumes(workload.lora, workload.model.uri, base_volume="model")
    volumes += lora_volumes
    mounts += lora_mounts
    if _downloads_from_hub(workload):
        # Downloaded once per pod: a restarted container finds the checkpoint in the emptyDir
        volumes.append({"name": "hf-cache", "emptyDir": {}})
        mounts.append({"name": "hf-cache", "mountPath": HF_CACHE_DIR})
    args = engine_args(workload, deployment_id(owner.namespace, owner.name)) + (["--track", track] if track else [])
    container: dict[str, Any] = {
        "name": "sits", "image": workload.image, "args": args,
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "env": _env(workload),
        "resources": _resources(workload),
        "volumeMounts": mounts,
        "securityContext": dict(CONTAINER_SECURITY),
        # /health is readiness (503 while draining or unable to serve); /health/live fails only when
        # the engine is dead, so a drain or a busy spell never gets the pod restarted
        "startupProbe": _probe("/health/live", 10, 5, 180),  # a large checkpoint may load for 30 minutes
        "readinessProbe": _probe("/health", 5, 2, 3),
        "livenessProbe": _probe("/health/live", 10, 5, 6),
    }
    if workload.image_pull_policy:
        container["imagePullPolicy"] = workload.image_pull_policy
    pod_spec: dict[str, Any] = {"containers": [container], "volumes": volumes, "securityContext": dict(POD_SECURITY),
                                "terminationGracePeriodSeconds": DRAIN_SECONDS}
    if workload.gpu_product:
        pod_spec["nodeSelector"] = {GPU_PRODUCT_LABEL: workload.gpu_product}
    if workload.gpus_per_replica > 0:
        pod_spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    labels = common_labels(owner.name)
    if track:
        labels[TRACK_LABEL] = track
    if revision:
        labels[REVISION_LABEL] = revision
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                   "prometheus.io/path": "/metrics"}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


def build_deployment(owner: Owner, track: str, track_plan: TrackPlan) -> dict[str, Any]:
    """The Deployment of one track (`x-stable` / `x-canary`), labelled and annotated with its revision."""
    selector = {DEPLOYMENT_LABEL: owner.name, TRACK_LABEL: track}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": object_meta(owner, deployment_name(owner.name, track), {TRACK_LABEL: track},
                                {REVISION_ANNOTATION: track_plan.revision}),
        "spec": {
            "replicas": track_plan.replicas,
            "selector": {"matchLabels": selector},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 1800,
            "template": build_pod_template(owner, track_plan.workload, track, track_plan.revision),
        },
    }


def build_config_map(owner: Owner, plan: Plan, tenants: list[TenantRecord] | None) -> dict[str, Any]:
    """The engine config of each running track, and the tenants file (API-key digests only)."""
    data = {"engine-stable.yaml": _engine_document(owner, plan.stable)}
    if plan.canary_active:
        data["engine-canary.yaml"] = _engine_document(owner, plan.canary)
    if tenants is not None:
        document = tenants_document([tenant.to_document() for tenant in tenants])
        data["tenants.yaml"] = yaml.safe_dump(document, sort_keys=False)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": object_meta(owner, config_map_name(owner.name)), "data": data}


def _engine_document(owner: Owner, track_plan: TrackPlan) -> str:
    document = {"revision": track_plan.revision, **track_plan.workload.to_dict(),
                "args": engine_args(track_plan.workload, deployment_id(owner.namespace, owner.name))}
    return yaml.safe_dump(document, sort_keys=True)


def writable_and_model_volumes(model_uri: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The writable emptyDirs a read-only root filesystem needs and, for a pvc:// model, its claim mounted
    read-only at MODEL_DIR: (volumes, mounts), shared by the runtime and the router pods."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for name, path in WRITABLE_DIRS:
        volumes.append({"name": name, "emptyDir": {}})
        mounts.append({"name": name, "mountPath": path})
    if model_uri.startswith("pvc://"):
        claim = model_uri[len("pvc://"):].partition("/")[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    return volumes, mounts
