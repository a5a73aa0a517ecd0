"""Fixtures of the operator tests: a KMock cluster, an API client, a Deployment controller, the operator."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kopf
import kubernetes.config.kube_config
import pytest
from kopf.testing import KopfRunner

from sits.operator.config import OperatorConfig
from sits.operator.handlers import register
from sits.operator.kube import KubeClient
from tests.operator.deployment_controller import DeploymentController
from tests.operator.helpers import WEBHOOK_TOKEN
from tests.operator.kmock_cluster import KMockCluster, kmock_cluster
from tests.support.services import free_port

RESYNC_S = 0.3  # the operator's clock in tests: pauses of 1 s and analysis every 2 s resolve on it


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KMockCluster]:
    with kmock_cluster(tmp_path) as started:
        monkeypatch.setenv("KUBECONFIG", str(started.kubeconfig))
        # The kubernetes client reads $KUBECONFIG once, at import
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(started.kubeconfig))
        yield started


@pytest.fixture
def kube(cluster: KMockCluster) -> Iterator[KubeClient]:
    client = KubeClient.from_environment(timeout_s=10)
    yield client
    client.close()


@pytest.fixture
def deployments(kube: KubeClient) -> Iterator[DeploymentController]:
    with DeploymentController(kube) as controller:
        yield controller


@pytest.fixture
def operator_config() -> OperatorConfig:
    return OperatorConfig(listen_host="127.0.0.1", webhook_port=free_port(), webhook_token=WEBHOOK_TOKEN,
                          resync_interval_s=RESYNC_S, tenancy_interval_s=0.5, health_port=0)


@pytest.fixture
def run_operator(cluster: KMockCluster, operator_config: OperatorConfig) -> Callable[..., Any]:
    """`with run_operator(): ...` runs the operator (kopf run, standalone, all namespaces) in a thread."""

    @contextlib.contextmanager
    def running(config: OperatorConfig | None = None) -> Iterator[KopfRunner]:
        config = config or operator_config
        registry = kopf.OperatorRegistry()
        register(registry, config)
        namespace = ["--namespace", config.namespace] if config.namespace else ["--all-namespaces"]
        with KopfRunner(["run", "--standalone", *namespace], registry=registry, timeout=30) as runner:
            yield runner
        assert runner.exception is None, runner.output[-3000:]

    return running

