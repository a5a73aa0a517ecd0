"""What a cluster would add around the operator in the end-to-end test: pods and a gateway.

`LocalKubelet` runs one real `sits serve` process per track, with exactly the arguments of the
container in the Deployment the operator wrote to KMock (only --host and --port are made local),
and lets the DeploymentController report the Deployment ready once the process answers /health.
`WeightedGateway` sends a steady load of completions, split between the tracks by the weights of
the HTTPRoute the operator wrote, as a Gateway API implementation would.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sits.operator.kube import ApiError, KubeClient
from tests.operator.deployment_controller import DeploymentController
from tests.operator.helpers import runtime_has_metrics_port, serve_args
from tests.support.services import RunningService, free_port

PROMPT = " ".join(["The lighthouse keeper walked along the northern coast at dawn."] * 6)


def local_argv(container_args: list[str], port: int, metrics_port: int) -> list[str]:
    """The container's `sits` arguments, listening on 127.0.0.1:port instead of 0.0.0.0:8000, and
    serving /metrics on 127.0.0.1:metrics_port instead of 9400 (on `port` for a runtime without
    --metrics-port)."""
    args = serve_args(container_args)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    if "--metrics-port" in args:
        args[args.index("--metrics-port") + 1] = str(metrics_port)
    return [sys.executable, "-m", "sits.runtime", *args]


class LocalKubelet:
    def __init__(self, kube: KubeClient, controller: DeploymentController, namespace: str, name: str) -> None:
        self.kube, self.controller, self.namespace, self.name = kube, controller, namespace, name
        self.ports = {track: free_port() for track in ("stable", "canary")}
        self.metrics_ports = {track: free_port() for track in ("stable", "canary")}
        self.processes: dict[str, RunningService] = {}
        self._args: dict[str, list[str]] = {}
        self._workdir = Path(tempfile.mkdtemp(prefix="sits-kubelet-"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet", daemon=True)
        for track in self.ports:
            controller.hold(self.deployment_name(track))

    def deployment_name(self, track: str) -> str:
        return f"{self.name}-{track}"

    def target(self, track: str) -> str:
        return f"127.0.0.1:{self.ports[track]}"

    def metrics_target(self, track: str) -> str:
        """Where Prometheus scrapes this track's /metrics (the pod's `metrics` port)."""
        port = self.metrics_ports[track] if runtime_has_metrics_port() else self.ports[track]
        return f"127.0.0.1:{port}"

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for track in self.ports:
                try:
                    self._sync(track)
                except ApiError:
                    continue

    def _sync(self, track: str) -> None:
        deployment = self.kube.get("apps/v1", "Deployment", self.namespace, self.deployment_name(track))
        if deployment is None or deployment["spec"].get("replicas", 0) == 0:
            return  # a scaled-down track keeps its process warm: no traffic reaches it
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        if self._args.get(track) != args:
            self.controller.hold(self.deployment_name(track))
            self._start(track, args)
        if self._healthy(track):
            self.controller.release(self.deployment_name(track))

    def _start(self, track: str, args: list[str]) -> None:
        if track in self.processes:
            self.processes.pop(track).stop()
        log = open(self._workdir / f"{track}.log", "ab")  # noqa: SIM115 - closed when the process ends
        argv = local_argv(args, self.ports[track], self.metrics_ports[track])
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        log.close()
        self.processes[track] = RunningService(process=process, port=self.ports[track], workdir=self._workdir)
        self._args[track] = args

    def _healthy(self, track: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.target(track)}/health", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in self._workdir.glob("*.log"))

    def __enter__(self) -> LocalKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._thread.join(10)
        for service in self.processes.values():
            service.stop()


class WeightedGateway:
    """`workers` clients in a loop, each request to canary with probability weight/100 (HTTPRoute)."""

    def __init__(self, kube: KubeClient, namespace: str, route: str, kubelet: LocalKubelet, model: str,
                 workers: int = 4) -> None:
        self.kube, self.namespace, self.route, self.kubelet, self.model = kube, namespace, route, kubelet, model
        self.canary_weight = 0
        self.sent = {"stable": 0, "canary": 0}
        self._stop = threading.Event()
        self._random = random.Random(0)
        self._threads = [threading.Thread(target=self._weights, name="gateway-weights", daemon=True)]
        self._threads += [threading.Thread(target=self._client, name=f"gateway-{i}", daemon=True) for i in range(workers)]

    def _weights(self) -> None:
        while not self._stop.wait(0.2):
            try:
                route = self.kube.get("gateway.networking.k8s.io/v1", "HTTPRoute", self.namespace, self.route)
            except ApiError:
                continue
            if route:
                backends = route["spec"]["rules"][-1]["backendRefs"]
                self.canary_weight = next((b["weight"] for b in backends if b["name"].endswith("-canary")), 0)

    def _client(self) -> None:
        body = json.dumps({"model": self.model, "prompt": PROMPT, "max_tokens": 8}).encode()
        while not self._stop.is_set():
            track = "canary" if self._random.random() * 100 < self.canary_weight else "stable"
            request = urllib.request.Request(f"http://{self.kubelet.target(track)}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    response.read()
                self.sent[track] += 1
            except (urllib.error.URLError, OSError):
                self._stop.wait(0.2)  # the track is not serving (yet)

    def __enter__(self) -> WeightedGateway:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(35)
