"""Small helpers of the operator tests: a SitsDeployment manifest, polling, reading status and metrics."""

from __future__ import annotations

import argparse
import copy
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sits.operator.kube import KubeClient
from sits.operator.meta import API_VERSION, KIND


def sitsdeployment(name: str, namespace: str = "llm", *, image: str = "registry.example.com/sits:1",
                   replicas: int = 2, **spec: Any) -> dict[str, Any]:
    """A small valid SitsDeployment; keyword arguments replace top-level spec fields."""
    body: dict[str, Any] = {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"name": "tiny", "uri": "hf://org/tiny"}, "image": image, "replicas": replicas,
                 "gpusPerReplica": 1},
    }
    body["spec"].update(copy.deepcopy(spec))
    return body


def wait_for(check: Callable[[], Any], timeout_s: float = 15.0, interval_s: float = 0.05, what: str = "") -> Any:
    """Poll until `check()` returns something truthy; return it, or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or check}; last value {last!r}")


def status_of(kube: KubeClient, name: str, namespace: str = "llm") -> dict[str, Any]:
    body = kube.get(API_VERSION, KIND, namespace, name) or {}
    return body.get("status") or {}


def wait_for_status(kube: KubeClient, name: str, predicate: Callable[[dict[str, Any]], bool],
                    timeout_s: float = 15.0, what: str = "", namespace: str = "llm") -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        status = status_of(kube, name, namespace)
        return status if predicate(status) else None
    try:
        return wait_for(check, timeout_s, what=what)
    except AssertionError as error:
        raise AssertionError(f"{error}\nstatus now: {status_of(kube, name, namespace)}") from None


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c.get("type") == kind), None)


def deployment(kube: KubeClient, name: str, track: str, namespace: str = "llm") -> dict[str, Any] | None:
    return kube.get("apps/v1", "Deployment", namespace, f"{name}-{track}")


def events(kube: KubeClient, name: str, namespace: str = "llm") -> list[dict[str, Any]]:
    return [e for e in kube.list("v1", "Event", namespace)
            if e.get("involvedObject", {}).get("name") == name]


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]  # (sample name, labels) -> value


def parse_metrics(exposition: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(exposition) for s in family.samples}


def scrape(port: int) -> Samples:
    """The operator's /metrics on 127.0.0.1:port (Prometheus' text format)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return parse_metrics(response.read().decode())


def scrape_when(port: int, ready: Callable[[Samples], Any], what: str) -> Samples:
    """Scrape until `ready(samples)` holds: the operator records its metrics after it writes the status."""
    found: list[Samples] = []

    def check() -> bool:
        found[:] = [scrape(port)]
        return bool(ready(found[0]))

    wait_for(check, what=what)
    return found[0]


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the sample with exactly these labels (None when there is none)."""
    return samples.get((name, frozenset(labels.items())))


def set_image(kube, name: str, image: str) -> None:
    kube.patch(API_VERSION, KIND, "llm", name, {"spec": {"image": image}})


WEBHOOK_TOKEN = "test-webhook-token-0123456789abcdef"  # the operator_config fixture's bearer token


def post_alerts(port: int, payload, token: str | None = WEBHOOK_TOKEN,
                authorization: str | None = None) -> tuple[int, dict]:
    """POST a payload to the webhook as Alertmanager would (`Authorization: Bearer <token>`)."""
    headers = {"Content-Type": "application/json"}
    if authorization is not None or token is not None:
        headers["Authorization"] = authorization if authorization is not None else f"Bearer {token}"
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/alertmanager", method="POST", data=body,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def firing(namespace: str, name: str, status: str = "firing") -> dict:
    return {"status": status, "labels": {"alertname": "SitsCanaryP95Delta", "namespace": namespace,
                                         "sitsdeployment": name},
            "annotations": {"summary": "canary P95 exceeds stable by more than 50 ms"},
            "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))}


def runtime_has_metrics_port() -> bool:
    """Whether this checkout's `sits serve` takes `--metrics-port` (the flag the operator gives its pods)."""
    from sits.runtime.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return "--metrics-port" in subparsers.choices["serve"]._option_string_actions


def serve_args(container_args: list[str]) -> list[str]:
    """A runtime container's args as this checkout's `sits serve` takes them: a runtime without
    `--metrics-port` serves /metrics on its API port, so the flag is dropped for it."""
    args = list(container_args)
    if "--metrics-port" in args and not runtime_has_metrics_port():
        index = args.index("--metrics-port")
        del args[index:index + 2]
    return args
