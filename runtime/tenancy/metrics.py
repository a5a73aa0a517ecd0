"""Prometheus metrics of the tenancy layer, read from one snapshot per scrape.

    sits_kv_blocks_used{tenant}        blocks a tenant holds (running + cached), gauge
    sits_kv_blocks_guaranteed{tenant}  its guaranteed share, gauge
    sits_kv_blocks_borrowed{tenant}    blocks held beyond the guarantee, gauge
    sits_kv_evictions_total{tenant}    cached blocks of the tenant evicted, counter
    sits_rate_limited_total{tenant}    requests refused with 429, counter
    sits_state_store_up                1 when the state store's backend is reachable, gauge

Every series carries the server's `model` and `track` labels (and `tenant` where per tenant), so
they line up with the server's own metrics. Register one `TenancyCollector` in the server's
registry; it never reaches into the cache or the store, it only reads the snapshot it is given
(once per scrape, as every `sits.runtime.metrics_collector.SnapshotCollector`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sits.runtime.metrics_collector import LABELS, SERVER_LABELS, SnapshotCollector
from sits.runtime.tenancy.shards import ShardUsage


@dataclass(frozen=True)
class TenancySnapshot:
    """What the collector exports, gathered by whoever owns the parts (cheap dict copies)."""

    blocks: Mapping[str, ShardUsage] = field(default_factory=dict)
    evictions_total: Mapping[str, int] = field(default_factory=dict)
    rate_limited_total: Mapping[str, int] = field(default_factory=dict)
    state_store_up: bool = True
    tenants: tuple[str, ...] = ()  # every configured tenant gets a series, zero when idle
    replica_id: str | None = None  # this replica's name in the state store (the router maps URLs to it)


class TenancyCollector(SnapshotCollector[TenancySnapshot]):
    """A prometheus_client custom collector over `TenancySnapshot`s (`SnapshotCollector`)."""

    FAMILIES = (
        *((GaugeMetricFamily, name, LABELS) for name in
          ("sits_kv_blocks_used", "sits_kv_blocks_guaranteed", "sits_kv_blocks_borrowed")),
        *((CounterMetricFamily, name, LABELS) for name in ("sits_kv_evictions", "sits_rate_limited")),
        (GaugeMetricFamily, "sits_state_store_up", SERVER_LABELS),
    )

    def _families(self, snap: TenancySnapshot) -> Iterator[Metric]:
        tenants = sorted(set(snap.tenants) | set(snap.blocks) | set(snap.evictions_total)
                         | set(snap.rate_limited_total))
        blocks = {t: snap.blocks.get(t, ShardUsage(0, 0, 0)) for t in tenants}
        yield self._per_tenant(GaugeMetricFamily, "sits_kv_blocks_used",
                               "KV-cache blocks a tenant holds: its running requests' and its cached blocks.",
                               {t: u.held for t, u in blocks.items()})
        yield self._per_tenant(GaugeMetricFamily, "sits_kv_blocks_guaranteed",
                               "KV-cache blocks guaranteed to a tenant (kvCacheShare x total).",
                               {t: u.guaranteed for t, u in blocks.items()})
        yield self._per_tenant(GaugeMetricFamily, "sits_kv_blocks_borrowed",
                               "KV-cache blocks a tenant holds beyond its guarantee.",
                               {t: u.borrowed for t, u in blocks.items()})
        yield self._per_tenant(CounterMetricFamily, "sits_kv_evictions",
                               "Cached KV blocks of a tenant evicted to make room.",
                               {t: snap.evictions_total.get(t, 0) for t in tenants})
        yield self._per_tenant(CounterMetricFamily, "sits_rate_limited",
                               "Requests refused with 429 for a tenant's RPM or TPM limit.",
                               {t: snap.rate_limited_total.get(t, 0) for t in tenants})
        yield self._single(GaugeMetricFamily, "sits_state_store_up", "1 when the tenancy state store is reachable.",
                           1.0 if snap.state_store_up else 0.0)
        if snap.replica_id is not None:
            info = GaugeMetricFamily("sits_state_store_replica", "1, labelled with this replica's name in the "
                                     "state store (its KV state for routers is published under it).",
                                     labels=("model", "track", "replica_id"))
            info.add_metric([self._model, self._track, snap.replica_id], 1.0)
            yield info
