"""A stand-in for kube-controller-manager, which KMock does not have: it marks Deployments ready."""

from __future__ import annotations

import threading
from typing import Any

from sits.operator.kube import ApiError, KubeClient


class DeploymentController:
    """Marks every Deployment ready (replicas, ready, updated, observedGeneration) unless held.

    `hold(name)` keeps a Deployment at zero ready pods, as a pod that never passes its readiness
    probe would; `release(name)` lets it become ready.
    """

    def __init__(self, kube: KubeClient, poll_s: float = 0.05) -> None:
        self.kube = kube
        self.poll_s = poll_s
        self._held: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deployment-controller", daemon=True)

    def hold(self, name: str) -> None:
        self._held.add(name)

    def release(self, name: str) -> None:
        self._held.discard(name)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
            except ApiError:
                continue  # the emulator is shutting down

    def _tick(self) -> None:
        for deployment in self.kube.list("apps/v1", "Deployment", None):
            meta, spec = deployment["metadata"], deployment.get("spec", {})
            replicas = spec.get("replicas", 1)
            ready = 0 if meta["name"] in self._held else replicas
            status = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas,
                      "availableReplicas": ready, "observedGeneration": meta.get("generation", 1)}
            current = deployment.get("status") or {}
            if any(current.get(key) != value for key, value in status.items()):
                self.kube.patch("apps/v1", "Deployment", meta["namespace"], meta["name"], {"status": status},
                                subresource="status")

    def __enter__(self) -> DeploymentController:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._thread.join(10)

