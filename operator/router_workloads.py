"""Pure builders of `spec.router`: the router's Deployment, Service and least-privilege RBAC.

One SitsDeployment `x` with `spec.router.enabled` also owns ServiceAccount, Role, RoleBinding,
Deployment and Service `x-router`. The router pods find the runtime pods from the ready
EndpointSlices of `x-stable` and `x-canary` (`sits router --discover`), which is all the Role
grants: get/list/watch of `discovery.k8s.io` EndpointSlices in the resource's namespace. The
model's Service `x` selects the router pods (networking.build_services), so clients keep their URL.

Without a Gateway API route, the router applies the rollout's canary weight and canary tenants
itself: they are flags of its pods, so each rollout step rolls the router pods (a few seconds; the
router rebuilds its prefix index from the state store).
"""

from __future__ import annotations

from typing import Any

from sits.operator.meta import (
    METRICS_PORT,
    SERVICE_PORT,
    SERVICE_ROLE_LABEL,
    Owner,
    config_map_name,
    deployment_id,
    object_meta,
    service_name,
)
from sits.operator.plan import Plan
from sits.operator.spec import SitsDeploymentSpec, WorkloadSpec
from sits.operator.workloads import (
    CONFIG_DIR,
    CONTAINER_SECURITY,
    POD_SECURITY,
    RUNTIME_HOME,
    TENANTS_FILE,
    _model_path,
    writable_and_model_volumes,
)

ROUTER_LABEL = "sits.ai/router"  # on router pods: the SitsDeployment's name (not sits.ai/deployment)
ROUTER_PORT = 8080  # `sits router --port`
RBAC_API = "rbac.authorization.k8s.io/v1"
# Small: the router tokenizes and proxies; it holds no model weights and no GPU
RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
# (apiVersion, kind) of every object below: deleted when spec.router is disabled
ROUTER_KINDS = (("v1", "ServiceAccount"), (RBAC_API, "Role"), (RBAC_API, "RoleBinding"),
                ("apps/v1", "Deployment"), ("v1", "Service"))


def router_name(name: str) -> str:
    return f"{name}-router"


def router_pod_labels(name: str) -> dict[str, str]:
    """The router pods' labels. Without `sits.ai/deployment`, so neither the runtime Services nor
    the PodDisruptionBudget of the replicas select them."""
    return {"app.kubernetes.io/name": "sits-router", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": "router", ROUTER_LABEL: name}


def router_args(owner: Owner, spec: SitsDeploymentSpec, plan: Plan) -> list[str]:
    """`sits router` flags: the replicas' Services, state store, tenants, tokenizer and the canary split.

    The tokenizer flags are the stable track's (`--model`, `--served-model-name`, `--block-size`),
    so the router hashes prompts as the replicas do; an hf:// model gives no `--model` (the spec
    allows that only for policies that need no replica-exact hashes).
    """
    workload = plan.stable.workload
    router = spec.router
    args = ["router", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--discover", f"{owner.namespace}/{service_name(owner.name, 'stable')}",
            "--discover", f"{owner.namespace}/{service_name(owner.name, 'canary')}",
            "--replica-metrics-port", str(METRICS_PORT),  # the replicas' /metrics: state-store name, track
            "--deployment", deployment_id(owner.namespace, owner.name), "--policy", router.policy]
    if router.weights:
        args += ["--weights", router.weights_arg()]
    if workload.redis_url:
        args += ["--state-store", workload.redis_url]
    if workload.tenants_file:
        args += ["--tenants", TENANTS_FILE]
    if not workload.model.uri.startswith("hf://"):
        args += ["--model", _model_path(workload.model.uri)]
    args += ["--served-model-name", workload.model.name, "--block-size", str(workload.engine.kv_block_size)]
    if plan.canary_active and spec.rollout.gateway_api is None:
        args += ["--canary-weight", str(plan.canary_weight)]
        if spec.rollout.canary.tenants:
            args += ["--canary-tenants", ",".join(spec.rollout.canary.tenants)]
    return args


def _volumes(owner: Owner, workload: WorkloadSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runtime pods' ConfigMap (tenants file) and model volume, read-only, and writable emptyDirs."""
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": config_map_name(owner.name)}}]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    extra_volumes, extra_mounts = writable_and_model_volumes(workload.model.uri)
    return volumes + extra_volumes, mounts + extra_mounts


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "timeoutSeconds": 2,
            "failureThreshold": failures}


def build_router_deployment(owner: Owner, spec: SitsDeploymentSpec, plan: Plan) -> dict[str, Any]:
    """Deployment `x-router`: `spec.router.replicas` pods of the runtime image running `sits router`."""
    workload = plan.stable.workload
    volumes, mounts = _volumes(owner, workload)
    container: dict[str, Any] = {
        "name": "router", "image": workload.image, "command": ["sits"], "args": router_args(owner, spec, plan),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": RUNTIME_HOME}],
        "resources": {kind: dict(values) for kind, values in RESOURCES.items()},
        "volumeMounts": mounts,
        "securityContext": dict(CONTAINER_SECURITY),
        # /health is 200 while a replica is up (the tokenizer is loaded before the router listens);
        # /health/live fails only when the router itself does: replicas loading or down never restart it
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health/live", 10, 6),
    }
    if workload.image_pull_policy:
        container["imagePullPolicy"] = workload.image_pull_policy
    labels = router_pod_labels(owner.name)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": object_meta(owner, router_name(owner.name), {"app.kubernetes.io/component": "router"}),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": {ROUTER_LABEL: owner.name}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {"labels": labels,
                             "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT),
                                             "prometheus.io/path": "/metrics"}},
                "spec": {"serviceAccountName": router_name(owner.name), "containers": [container],
                         "volumes": volumes, "securityContext": dict(POD_SECURITY),
                         "terminationGracePeriodSeconds": 10},
            },
        },
    }


def build_router_service(owner: Owner) -> dict[str, Any]:
    """Service `x-router` (port `http`, 80): the router pods alone."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": object_meta(owner, router_name(owner.name), {SERVICE_ROLE_LABEL: "router"}),
            "spec": {"type": "ClusterIP", "selector": {ROUTER_LABEL: owner.name},
                     "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def build_router_rbac(owner: Owner) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding `x-router`: EndpointSlices of this namespace, read-only."""
    name = router_name(owner.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(owner, name),
         "automountServiceAccountToken": True},
        {"apiVersion": RBAC_API, "kind": "Role", "metadata": object_meta(owner, name),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": object_meta(owner, name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]},
    ]


def build_router_objects(owner: Owner, spec: SitsDeploymentSpec, plan: Plan) -> list[dict[str, Any]]:
    """Everything `spec.router` asks for, in apply order (none when it is disabled)."""
    if not spec.router.enabled:
        return []
    return [*build_router_rbac(owner), build_router_deployment(owner, spec, plan), build_router_service(owner)]
