"""`sits router --discover NAMESPACE/SERVICE`: the pool follows the Service's EndpointSlices, served
by KMock (a Kubernetes API double), in front of one real `sits serve` replica."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.operator.kmock_cluster import KMockCluster, kmock_cluster
from tests.support.services import RunningService, free_port, started

NAMESPACE, SERVICE = "llm", "shop-stable"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def endpoint_slice(name: str, service: str, port: int, ready: bool = True) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}]}


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory) -> Iterator[tuple[KMockCluster, RunningService, RunningService]]:
    workdir = tmp_path_factory.mktemp("discovery")
    with contextlib.ExitStack() as stack:
        kube = stack.enter_context(kmock_cluster(workdir))
        port = free_port()
        replica = stack.enter_context(started(
            [sys.executable, "-m", "sits.runtime", "serve", "--model", str(tiny_llama_dir), "--served-model-name",
             "tiny", "--device", "cpu", "--port", str(port), "--num-blocks", "32", "--max-model-len", "256"],
            port, timeout_s=120, workdir=workdir, log_name="serve.log"))
        wait_until(lambda: httpx.get(f"{replica.url}/health").status_code == 200, 120, "a ready replica")
        router_port = free_port()
        router = stack.enter_context(started(
            [sys.executable, "-m", "sits.runtime.router", "--port", str(router_port), "--discover",
             f"{NAMESPACE}/{SERVICE}", "--kube-api", kube.url, "--model", str(tiny_llama_dir)],
            router_port, timeout_s=60, workdir=workdir, log_name="router.log"))
        yield kube, replica, router


def replicas_up(router: RunningService) -> int:
    return httpx.get(f"{router.url}/health").json()["replicas_up"]


def test_the_pool_follows_the_services_ready_endpoints(setup):
    kube, replica, router = setup
    assert httpx.get(f"{router.url}/health").status_code == 503  # no endpoint yet
    assert httpx.get(f"{router.url}/health/live").status_code == 200  # but alive: no restart for it
    # Another Service's slice in the same namespace is not ours (the router filters by the label).
    httpx.post(f"{kube.url}{SLICES}", json=endpoint_slice("other-x1", "other", replica.port)).raise_for_status()
    httpx.post(f"{kube.url}{SLICES}", json=endpoint_slice("shop-x1", SERVICE, replica.port)).raise_for_status()
    wait_until(lambda: replicas_up(router) == 1, 10, "the endpoint in the pool")
    reply = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                       timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    # The endpoint turns not ready (the pod is terminating): it leaves the pool.
    not_ready = {"endpoints": endpoint_slice("shop-x1", SERVICE, replica.port, ready=False)["endpoints"]}
    httpx.patch(f"{kube.url}{SLICES}/shop-x1", json=not_ready,
                headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()
    wait_until(lambda: replicas_up(router) == 0, 10, "the endpoint out of the pool")
    assert httpx.get(f"{router.url}/health").status_code == 503
