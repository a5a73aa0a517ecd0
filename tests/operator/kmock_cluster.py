"""A Kubernetes API for operator tests: KMock's emulator (`FixedEmulator`) served on 127.0.0.1.

`KMockCluster` runs it in its own thread and event loop, writes a kubeconfig for it, and registers
the built-in resources plus the CRDs the operator uses. KMock has no kube-controller-manager:
`tests.operator.deployment_controller.DeploymentController` stands in for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp.test_utils
import kmock
import yaml

from tests.operator.kmock_emulator import FixedEmulator

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "sitsdeployment.yaml"
EXTRA_RESOURCES = {
    "gateway.networking.k8s.io/v1/httproutes": ("HTTPRoute", "httproute"),
    "monitoring.coreos.com/v1/servicemonitors": ("ServiceMonitor", "servicemonitor"),
    "monitoring.coreos.com/v1/prometheusrules": ("PrometheusRule", "prometheusrule"),
}
VERBS = {"list", "watch", "get", "create", "update", "patch", "delete"}


def _resource_infos() -> dict[str, kmock.ResourceInfo]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    names = crd["spec"]["names"]
    infos = {}
    for version in crd["spec"]["versions"]:
        infos[f"{crd['spec']['group']}/{version['name']}/{names['plural']}"] = kmock.ResourceInfo(
            namespaced=crd["spec"]["scope"] == "Namespaced", kind=names["kind"], singular=names["singular"],
            verbs=VERBS, shortnames=set(names.get("shortNames", [])), categories=set(names.get("categories", [])),
            subresources=set(version.get("subresources", {})))
    for key, (kind, singular) in EXTRA_RESOURCES.items():
        infos[key] = kmock.ResourceInfo(namespaced=True, kind=kind, singular=singular, verbs=VERBS)
    return infos


class KMockCluster:
    """The emulator served on 127.0.0.1 from its own thread and loop, with a kubeconfig pointing at it."""

    def __init__(self, workdir: Path) -> None:
        self.emulator = FixedEmulator()
        self.emulator.resources.load_bundled()
        for key, info in _resource_infos().items():
            self.emulator.resources[key] = info
        self.kubeconfig = workdir / "kubeconfig"
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        # asyncio.run: when the server stops, the watches still streaming are cancelled and their generators
        # closed inside this loop. Left pending, they were finalized later by the garbage collector, from
        # another test and loop ("is bound to a different event loop").
        try:
            asyncio.run(self._serve())
        except BaseException as error:  # noqa: BLE001 - reported to the starting thread
            self._error = error
            self._started.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self.emulator:
            server = aiohttp.test_utils.RawTestServer(self.emulator, host="127.0.0.1", port=0)
            await server.start_server()
            self.port = server.port
            self._started.set()
            try:
                await self._stop.wait()
            finally:
                await server.close()

    def start(self) -> KMockCluster:
        self._thread.start()
        self._started.wait(10)
        if self._error is not None or not self.port:
            raise RuntimeError(f"KMock did not start: {self._error!r}")
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }))
        return self

    def stop(self) -> None:
        if self._stop is not None and self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def kmock_cluster(workdir: Path) -> Iterator[KMockCluster]:
    """A started cluster; stopped when the block ends."""
    cluster = KMockCluster(workdir).start()
    try:
        yield cluster
    finally:
        cluster.stop()
