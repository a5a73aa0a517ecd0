"""A small REST client over the official `kubernetes` client's auth and transport, and `apply`.

`KubeClient.apply(obj)` makes an object look like `obj` idempotently: it creates what is missing
and server-side-applies (field manager `sits-operator`) what differs, so fields the operator set
before and no longer wants are removed. It does nothing when the object still carries the digest
of `obj` and every field `obj` sets has that value, so a reconcile run twice writes nothing the
second time.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Mapping
from typing import Any

import kubernetes.client
import kubernetes.config

from sits.operator.meta import MANAGED_BY, Owner

logger = logging.getLogger("sits.operator.kube")

MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply; JSON is YAML
APPLIED_ANNOTATION = "sits.ai/applied"  # digest of what the operator last applied to an object

# kind -> plural, for the kinds the operator reads or writes
PLURALS = {
    "ConfigMap": "configmaps", "Secret": "secrets", "Service": "services", "Event": "events",
    "Deployment": "deployments", "PodDisruptionBudget": "poddisruptionbudgets", "HTTPRoute": "httproutes",
    "ServiceMonitor": "servicemonitors", "PrometheusRule": "prometheusrules", "SitsDeployment": "sitsdeployments",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",  # spec.router
}


class ApiError(Exception):
    """The API server refused a request (status is the HTTP code; 0 when it could not be reached)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def digest(obj: dict[str, Any]) -> str:
    """A short hash of an object as built (what `apply` compares with what it applied last)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def is_subset(desired: Any, actual: Any) -> bool:
    """Every field `desired` sets has the same value in `actual` (lists compared element-wise)."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(is_subset(v, actual.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(desired) == len(actual)
                and all(is_subset(d, a) for d, a in zip(desired, actual, strict=True)))
    if isinstance(desired, str) and isinstance(actual, int | float) and not isinstance(actual, bool):
        return desired == str(actual)  # quantities the server normalised
    return desired == actual


class KubeClient:
    """Thread-safe; one per operator. `timeout_s` bounds every request."""

    def __init__(self, api_client: kubernetes.client.ApiClient, timeout_s: float = 30.0) -> None:
        self.api = api_client
        self.timeout_s = timeout_s

    @classmethod
    def from_environment(cls, timeout_s: float = 30.0) -> KubeClient:
        """In-cluster service account when running in a pod, else $KUBECONFIG (or ~/.kube/config)."""
        configuration = kubernetes.client.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            return cls(kubernetes.client.ApiClient(configuration), timeout_s)
        config_file = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        return cls(kubernetes.config.new_client_from_config(config_file=config_file.split(os.pathsep)[0],
                                                            persist_config=False), timeout_s)

    def close(self) -> None:
        self.api.close()

    def request(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
                content_type: str = "application/json") -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, _ = self.api.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
            auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(method, url, headers, body, _request_timeout=self.timeout_s)
        except kubernetes.client.ApiException as error:
            raise ApiError(error.status or 0, str(error.reason), str(error.body or "")) from None
        except Exception as error:  # urllib3 connection errors and timeouts
            raise ApiError(0, "Unreachable", f"{type(error).__name__}: {error}") from None
        data = response.read() or b""
        try:
            parsed = json.loads(data) if data else {}
        except ValueError:
            parsed = {"message": data[:200].decode("utf-8", "replace")}
        if not 200 <= response.status < 300:
            message = parsed.get("message", "") if isinstance(parsed, dict) else ""
            raise ApiError(response.status, str(response.reason), message)
        return parsed

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return self.request("GET", resource_path(api_version, kind, namespace), query=query).get("items") or []

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), obj)

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: Any,
              subresource: str | None = None, content_type: str = MERGE_PATCH,
              query: dict[str, str] | None = None) -> dict[str, Any]:
        return self.request("PATCH", resource_path(api_version, kind, namespace, name, subresource), patch,
                            query=query, content_type=content_type)

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        try:
            self.request("DELETE", resource_path(api_version, kind, namespace, name))
            return True
        except ApiError as error:
            if error.status == 404:
                return False
            raise

    def apply(self, obj: dict[str, Any]) -> str:
        """Create or server-side-apply `obj`; returns "created", "updated" or "unchanged"."""
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        meta.setdefault("annotations", {})[APPLIED_ANNOTATION] = digest(obj)
        current = self.get(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        if current is None:
            try:
                self.create(obj)
                return "created"
            except ApiError as error:
                if error.status != 409:
                    raise
                current = {}
        desired = {key: value for key, value in obj.items() if key not in ("apiVersion", "kind", "status")}
        if is_subset(desired, current):  # the same digest, and nothing drifted
            return "unchanged"
        self.patch(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], obj,
                   content_type=APPLY_PATCH, query={"fieldManager": MANAGED_BY, "force": "true"})
        return "updated"

    def post_event(self, owner: Owner, event_type: str, reason: str, message: str) -> None:
        """A core/v1 Event about the SitsDeployment (best effort: failures are logged, not raised)."""
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # Events take whole seconds
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{owner.name}.{secrets.token_hex(8)}", "namespace": owner.namespace},
            "involvedObject": {"apiVersion": "sits.ai/v1alpha1", "kind": "SitsDeployment", "name": owner.name,
                               "namespace": owner.namespace, "uid": owner.uid},
            "type": event_type, "reason": reason, "message": message[:1024],
            "source": {"component": MANAGED_BY}, "reportingComponent": f"sits.ai/{MANAGED_BY}",
            "reportingInstance": os.environ.get("HOSTNAME", MANAGED_BY),
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            self.create(event)
        except ApiError as error:
            logger.warning("could not post Event %s on %s/%s: %s", reason, owner.namespace, owner.name, error)

