"""Scrape targets for Prometheus in analysis tests: a runtime's latency histogram at a chosen latency.

Each `LatencySource` serves `/metrics` with `sits_request_latency_seconds` (labels model, tenant,
track, the runtime's buckets) as if `rate_per_s` requests of `latency_s` each finished every second.
The latency can change while it runs (`latency_s = ...`): a canary that turns slow. Prometheus
scrapes it like a runtime replica; the end-to-end test scrapes real runtimes instead.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import HistogramMetricFamily

from tests.support.services import free_port

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 15.0,
           20.0, 30.0, 45.0, 60.0)


class LatencySource:
    def __init__(self, track: str, latency_s: float, rate_per_s: float = 20.0) -> None:
        self.track = track
        self.latency_s = latency_s
        self.rate_per_s = rate_per_s
        self._counts = [0.0] * (len(BUCKETS) + 1)  # per bucket, +Inf last
        self._sum = 0.0
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.port = free_port()

    def _advance(self) -> None:
        now = time.monotonic()
        requests = (now - self._last) * self.rate_per_s
        self._last = now
        index = next((i for i, bound in enumerate(BUCKETS) if self.latency_s <= bound), len(BUCKETS))
        self._counts[index] += requests
        self._sum += requests * self.latency_s

    def collect(self) -> Iterator[Any]:
        with self._lock:
            self._advance()
            cumulative, buckets = 0.0, []
            for bound, count in zip((*map(str, BUCKETS), "+Inf"), self._counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            total = self._sum
        family = HistogramMetricFamily("sits_request_latency_seconds", "End-to-end request latency.",
                                       labels=["model", "tenant", "track"])
        family.add_metric(["tiny", "default", self.track], buckets, total)
        yield family

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.contextmanager
def serving(*sources: LatencySource) -> Iterator[None]:
    """Serve each source's /metrics on its port until the block ends."""
    servers = []
    try:
        for source in sources:
            registry = CollectorRegistry()
            registry.register(source)
            servers.append(start_http_server(source.port, addr="127.0.0.1", registry=registry))
        yield
    finally:
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join(5)


def scrape_config(jobs: dict[tuple[str, str], list[LatencySource]], interval: str = "1s") -> str:
    """prometheus.yml scraping each (namespace, sitsdeployment)'s sources with those target labels."""
    lines = ["global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}", "scrape_configs:"]
    for (namespace, name), sources in jobs.items():
        targets = ", ".join(f"'{s.target}'" for s in sources)
        lines += [f"  - job_name: '{namespace}-{name}'", "    static_configs:",
                  f"      - targets: [{targets}]",
                  f"        labels: {{namespace: '{namespace}', sitsdeployment: '{name}'}}"]
    return "\n".join(lines) + "\n"
