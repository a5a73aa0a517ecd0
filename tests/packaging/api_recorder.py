"""Which Kubernetes API calls a client makes: KMock's emulator, recording (verb, group, resource, scope).

`RecordingCluster` is the operator tests' KMock cluster whose emulator notes every resource
request made with the kubeconfig's token (the operator's), as the API server's authorizer sees
it: the verb (`get`, `list`, `watch`, `create`, `patch`, `update`, `delete`), the API group, the
resource with its subresource (`sitsdeployments/status`) and whether it was cluster-wide (no
namespace in the path). Requests made with another token, such as the test's own client from
`driver_kubeconfig`, are not recorded. Discovery (`/api`, `/apis`, `/version`) is not a resource
request; every authenticated user may read it (the `system:discovery` role), so it is not noted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import yaml

from tests.operator.kmock_cluster import KMockCluster, _resource_infos
from tests.operator.kmock_emulator import FixedEmulator

OPERATOR_TOKEN = "kmock"  # what KMockCluster's kubeconfig carries
DRIVER_TOKEN = "test-driver"

_VERBS = {
    kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
    kmock.action.CREATE: "create", kmock.action.DELETE: "delete",
}


@dataclass(frozen=True, order=True)
class ApiCall:
    """One (verb, resource) pair as RBAC names it."""

    group: str
    resource: str  # plural, or plural/subresource
    verb: str
    cluster_wide: bool


class RecordingEmulator(FixedEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.calls: set[ApiCall] = set()
        self._calls_lock = threading.Lock()

    async def _handle(self, request: kmock.Request) -> Any:
        self._note(request)
        return await super()._handle(request)

    def _note(self, request: kmock.Request) -> None:
        if request.resource is None or request.action is None or not request.resource.plural:
            return  # discovery of a group or version
        if request.headers.get("Authorization", "") != f"Bearer {OPERATOR_TOKEN}":
            return
        verb = _VERBS.get(request.action)
        if request.action == kmock.action.UPDATE:
            verb = "update" if request.method.upper() == "PUT" else "patch"
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        call = ApiCall(group=request.resource.group or "", resource=resource, verb=verb,
                       cluster_wide=request.namespace is None)
        with self._calls_lock:
            self.calls.add(call)


class RecordingCluster(KMockCluster):
    """KMockCluster with a RecordingEmulator (and the same resources registered)."""

    def __init__(self, workdir: Path, extra_resources: dict[str, kmock.ResourceInfo] | None = None) -> None:
        super().__init__(workdir)
        self.emulator = RecordingEmulator()
        self.emulator.resources.load_bundled()
        for key, info in {**_resource_infos(), **(extra_resources or {})}.items():
            self.emulator.resources[key] = info
        self.driver_kubeconfig = workdir / "driver-kubeconfig"

    def start(self) -> RecordingCluster:
        super().start()
        config = yaml.safe_load(self.kubeconfig.read_text())
        config["users"][0]["user"]["token"] = DRIVER_TOKEN
        self.driver_kubeconfig.write_text(yaml.safe_dump(config))
        return self

    @property
    def calls(self) -> set[ApiCall]:
        with self.emulator._calls_lock:
            return set(self.emulator.calls)
