"""Names, labels and owner references shared by every object the operator builds.

One SitsDeployment `x` owns: ConfigMap `x-engine`, Deployments `x-stable` and `x-canary`,
Services `x` (both tracks), `x-stable` and `x-canary`, PodDisruptionBudget `x`, and optionally
the HTTPRoute the spec names, ServiceMonitor `x`, PrometheusRule `x` and HorizontalPodAutoscaler `x`
(which scales `x` itself through its scale subresource).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP = "sits.ai"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "SitsDeployment"
PLURAL = "sitsdeployments"

MANAGED_BY = "sits-operator"
DEPLOYMENT_LABEL = "sits.ai/deployment"  # on every owned object and pod: the SitsDeployment's name
TRACK_LABEL = "track"  # stable | canary, on Deployments, pods and the per-track Services
REVISION_LABEL = "sits.ai/revision"  # the pod-template hash, on pods and Deployments
SERVICE_ROLE_LABEL = "sits.ai/service"  # all | stable | canary
REVISION_ANNOTATION = "sits.ai/revision"
RESUME_ANNOTATION = "sits.ai/resume"  # continue past a pause (kubectl argo rollouts promote)
ABORT_ANNOTATION = "sits.ai/abort"  # back to stable now, and stay there (kubectl argo rollouts abort)
PROMOTE_ANNOTATION = "sits.ai/promote"  # "full": skip the remaining steps (kubectl argo rollouts promote --full)
RETRY_ANNOTATION = "sits.ai/retry"  # start an aborted or rolled back canary again (kubectl argo rollouts retry)
TRACKS = ("stable", "canary")

HTTP_PORT = 8000  # the runtime's API port: /health and /v1/*
# The runtime's Prometheus port (`sits serve --metrics-port`): GET /metrics there, never on the API port,
# whose callers must not see every tenant's traffic. Pods name it `metrics`; the ServiceMonitors scrape it.
METRICS_PORT = 9400
SERVICE_PORT = 80


@dataclass(frozen=True)
class Owner:
    """The SitsDeployment that owns an object (what an ownerReference needs)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body.get("metadata", {})
        return cls(name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta.get("uid", ""))

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def deployment_id(namespace: str, name: str) -> str:
    """The runtime's `--deployment` of a SitsDeployment: its tenancy keys in Redis are `sits:{id}:...`.

    Namespaces are DNS labels (no dots), so `{namespace}.{name}` never names two resources.
    """
    return f"{namespace}.{name}"


def config_map_name(name: str) -> str:
    return f"{name}-engine"


def deployment_name(name: str, track: str) -> str:
    return f"{name}-{track}"


def service_name(name: str, track: str | None = None) -> str:
    return name if track is None else f"{name}-{track}"


def common_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "sits", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/managed-by": MANAGED_BY, DEPLOYMENT_LABEL: name}


def object_meta(owner: Owner, name: str, labels: dict[str, str] | None = None,
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """metadata of an owned object: namespace, labels, and the controller owner reference."""
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace,
                            "labels": {**common_labels(owner.name), **(labels or {})},
                            "ownerReferences": [owner.reference()]}
    if annotations:
        meta["annotations"] = annotations
    return meta


def is_owned_by(obj: dict[str, Any], owner: Owner) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == owner.uid and ref.get("kind") == KIND for ref in refs)
