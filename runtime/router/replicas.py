"""The replicas behind the router: which are up, how busy the router keeps each, and who each is.

A replica is up while its `/health` answers 200. Each is probed every `interval_s` seconds (timeout
the same), and a refused connection on a proxied request takes it out at once, so a dead replica
leaves the pool within one probe interval plus its timeout. Its name in the state store (under
which it publishes its KV state) is read from its `/metrics` (`sits_state_store_replica`), on its
API port or, with `metrics_port` (`sits serve --metrics-port`), on that port of the same host.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

from sits.runtime.tasks import PeriodicTask

log = logging.getLogger(__name__)

REPLICA_LINE = re.compile(r'^sits_state_store_replica\{([^}]*)\}', re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Replica:
    """One replica as the router sees it.

    Attributes:
        url: its base URL (the `replica` label of the router's metrics).
        up: whether it takes requests now.
        in_flight: requests the router has sent it that have not finished (streams included).
        replica_id: its name in the state store, once read from its /metrics.
        track: "stable" or "canary" (its `sits serve --track`), read with the replica id.
    """

    url: str
    up: bool = True
    in_flight: int = 0
    replica_id: str | None = None
    track: str = "stable"


def metrics_url(url: str, metrics_port: int | None) -> str:
    """The /metrics URL of the replica at base `url`: on its API port, or on `metrics_port` of its host."""
    if metrics_port is None:
        return f"{url}/metrics"
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return urlunsplit((parts.scheme, f"{host}:{metrics_port}", "/metrics", "", ""))


class ReplicaPool:
    """The replicas, their health and in-flight counts.

    Args:
        urls: base URLs.
        client: the router's httpx client.
        interval_s: seconds between health probes of each replica (also their timeout).
        metrics_port: the replicas' `--metrics-port` (None: /metrics on the API port).
    """

    def __init__(self, urls: list[str], client: httpx.AsyncClient, interval_s: float = 1.0,
                 metrics_port: int | None = None) -> None:
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self._client = client
        self.interval_s = interval_s
        self.metrics_port = metrics_port
        self.probes = 0  # completed probe rounds (tests wait on it)
        self._probing = PeriodicTask(self.probe_all, interval_s, "sits-router-health")

    def up(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.up]

    def by_url(self, url: str) -> Replica | None:
        return next((replica for replica in self.replicas if replica.url == url), None)

    async def start(self) -> None:
        await self._probing.start_after_round()

    async def close(self) -> None:
        await self._probing.stop()

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take a replica out until its next good probe (a refused connection, a failed probe)."""
        if replica.up:
            log.warning("router: replica %s is down (%s)", replica.url, reason)
        replica.up = False

    def set_urls(self, urls: list[str]) -> tuple[list[Replica], list[str]]:
        """Make the pool these URLs (service discovery): returns (replicas added, not yet probed
        and so not up; URLs removed). Kept replicas keep their state."""
        wanted = list(dict.fromkeys(url.rstrip("/") for url in urls))
        removed = [r.url for r in self.replicas if r.url not in wanted]
        added = [Replica(url, up=False) for url in wanted if self.by_url(url) is None]
        self.replicas = [r for r in self.replicas if r.url in wanted] + added
        return added, removed

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(replica) for replica in list(self.replicas)))
        self.probes += 1

    async def probe(self, replica: Replica) -> None:
        """Ask the replica's /health (and, once up, who it is); up or down accordingly."""
        try:
            response = await self._client.get(f"{replica.url}/health", timeout=self.interval_s)
            healthy, reason = response.status_code == 200, f"/health answered {response.status_code}"
        except httpx.HTTPError as error:
            healthy, reason = False, type(error).__name__
        if not healthy:
            self.mark_down(replica, reason)
            return
        if not replica.up:
            log.info("router: replica %s is up", replica.url)
            replica.up, replica.replica_id = True, None  # a restarted replica publishes under a new name
        if replica.replica_id is None:
            await self._identify(replica)

    async def _identify(self, replica: Replica) -> None:
        """The replica's name in the state store and its track, from its /metrics (left unknown
        when it has none yet: the next probe asks again)."""
        try:
            response = await self._client.get(metrics_url(replica.url, self.metrics_port), timeout=self.interval_s)
        except httpx.HTTPError:
            return
        match = REPLICA_LINE.search(response.text) if response.status_code == 200 else None
        if match is not None:
            labels = dict(LABEL.findall(match.group(1)))
            replica.track = labels.get("track", "stable")
            replica.replica_id = labels.get("replica_id")
