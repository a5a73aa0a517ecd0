"""Finding the replicas in Kubernetes: the ready endpoints of the stable and canary Services.

`sits router --discover NAMESPACE/SERVICE` (repeat for each Service) lists the Service's
EndpointSlices (`discovery.k8s.io/v1`, label `kubernetes.io/service-name`) every `interval_s`
seconds and makes the pool follow them: each ready address becomes `http://ADDRESS:PORT` (the port
named `http`, else the slice's first). It needs only `get`/`list` on `endpointslices` in the
namespace. In a pod it uses the service account's token and CA; `--kube-api URL` points it
elsewhere. A failed listing keeps the pool as it is (the replicas' own health still applies).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sits.runtime.config import ConfigError
from sits.runtime.router.replicas import ReplicaPool
from sits.runtime.tasks import PeriodicTask

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class ServiceRef:
    """A Service whose endpoints are replicas."""

    namespace: str
    name: str

    @classmethod
    def parse(cls, text: str) -> ServiceRef:
        """`NAMESPACE/NAME`; raises ConfigError."""
        namespace, sep, name = text.partition("/")
        if not sep or not namespace or not name or "/" in name:
            raise ConfigError(f"--discover takes NAMESPACE/SERVICE, got {text!r}")
        return cls(namespace, name)


def slice_urls(item: dict[str, Any], port_name: str = "http") -> list[str]:
    """The replica URLs of one EndpointSlice: its ready endpoints' addresses on its `http` port."""
    ports = item.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and ports:
        port = ports[0].get("port")
    if port is None:
        return []
    urls = []
    for endpoint in item.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.append(f"http://{host}:{port}")
    return urls


class EndpointSliceDiscovery:
    """Keeps `pool` equal to the ready endpoints of `services`.

    Args:
        services: the Services (stable and canary) whose endpoints are replicas.
        pool: the router's replicas.
        api_url: the Kubernetes API (None: in-cluster, from the service account).
        interval_s: seconds between listings.
    """

    def __init__(self, services: list[ServiceRef], pool: ReplicaPool, api_url: str | None = None, *,
                 interval_s: float = 2.0) -> None:
        self.services = services
        self.pool = pool
        self.interval_s = interval_s
        headers: dict[str, str] = {}
        verify: ssl.SSLContext | bool = True
        if api_url is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ConfigError("--discover outside a pod needs --kube-api URL")
            api_url = f"https://{host}:{port}"
            headers["Authorization"] = f"Bearer {(SERVICE_ACCOUNT / 'token').read_text().strip()}"
            verify = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        self.api_url = api_url.rstrip("/")
        self._client = httpx.AsyncClient(headers=headers, verify=verify, timeout=5.0)
        self._listing = PeriodicTask(self._sync, interval_s, "sits-router-discovery")
        self.listings = 0  # successful listings (tests wait on it)

    async def start(self) -> None:
        await self._listing.start_after_round()

    async def close(self) -> None:
        await self._listing.stop()
        await self._client.aclose()

    async def _sync(self) -> None:
        try:
            urls = await self.discover()
        except (httpx.HTTPError, ValueError) as error:
            log.warning("router: cannot list the replicas' EndpointSlices (%s); keeping the pool as it is", error)
            return
        added, removed = self.pool.set_urls(urls)
        for url in removed:
            log.info("router: replica %s left its Service", url)
        if added:
            log.info("router: replica(s) %s joined", ", ".join(r.url for r in added))
            await asyncio.gather(*(self.pool.probe(replica) for replica in added))
        self.listings += 1

    async def discover(self) -> list[str]:
        """The URLs of every ready endpoint of the Services, in a stable order."""
        urls: list[str] = []
        for service in self.services:
            response = await self._client.get(
                f"{self.api_url}/apis/discovery.k8s.io/v1/namespaces/{service.namespace}/endpointslices",
                params={"labelSelector": f"{SERVICE_LABEL}={service.name}"})
            response.raise_for_status()
            for item in response.json().get("items", []):
                if (item.get("metadata", {}).get("labels") or {}).get(SERVICE_LABEL) == service.name:
                    urls.extend(url for url in slice_urls(item) if url not in urls)
        return urls
