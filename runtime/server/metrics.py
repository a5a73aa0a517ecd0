"""Prometheus metrics of one server: per-request histograms and counters, engine state at scrape time.

Each app owns its `CollectorRegistry` (no module-level state), so two servers in one process (tests)
never share a counter. Every per-request series carries `model`, `tenant` and `track` labels: the operator's
canary analysis compares `track="canary"` against `track="stable"` latency quantiles. Engine-wide series
(engine steps, the engine process's CPU seconds, speculative decoding) carry `model` and `track`; the API
process's own `process_*` series (prometheus_client's ProcessCollector) carry none.

Engine state (running / waiting requests, KV-cache usage, prefix-cache and preemption counters, steps and
CPU seconds) is not pushed by the engine: `EngineStatsCollector` asks for one `EngineStats` snapshot per scrape (the
engine builds it then, between two steps: `sits.runtime.engine.stats`). The
tenancy layer's own series (KV shards, evictions, rate limits, state store) come from its collector,
registered next to these (`register`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sits.runtime.engine.stats import EngineStats
from sits.runtime.metrics_collector import LABELS, SERVER_LABELS, SnapshotCollector
from sits.runtime.server.tenant import DEFAULT_TENANT

# 5 ms to 60 s: first tokens on a warm GPU land in the first buckets, long CPU generations in the last.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
                   7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
SPEC_LABELS = SERVER_LABELS  # engine-wide series (speculative decoding, the host tier's totals)
TIER_LABELS = ("model", "tenant", "track", "tier")
HOST_TIER_COUNTERS = (  # (series, HostTierStats field, help)
    ("sits_kv_host_offload_bytes", "offload_bytes", "Bytes of KV blocks copied from the GPU cache to the host tier."),
    ("sits_kv_host_offload_seconds", "offload_seconds", "Device seconds spent copying KV blocks to the host tier."),
    ("sits_kv_host_onload_bytes", "onload_bytes", "Bytes of KV blocks copied back from the host tier to the GPU."),
    ("sits_kv_host_onload_seconds", "onload_seconds", "Device seconds spent copying KV blocks back from the host tier."),
    ("sits_kv_host_dropped_blocks", "dropped_blocks",
     "Evicted GPU blocks the host tier did not keep (the tenant's hostKvCacheShare was spent)."),
)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineStatsCollector(SnapshotCollector[EngineStats]):
    """Engine gauges and counters, read from one `EngineStats` snapshot per scrape.

    Every series is split by tenant from the snapshot's `*_by_tenant` maps ("default" always has a
    series, zero when idle). `sits_prefix_cache_cross_tenant_hits_total` counts prompt tokens served
    from blocks another tenant computed outside the shared-prefix pool: it must stay 0.
    Args: stats_source: the engine's `stats` (it builds the figures when called: once per scrape).
    """

    FAMILIES = (
        *((GaugeMetricFamily, name, LABELS) for name in
          ("sits_requests_running", "sits_requests_waiting", "sits_kv_cache_usage_ratio")),
        *((CounterMetricFamily, name, LABELS) for name in
          ("sits_prefix_cache_queries", "sits_prefix_cache_hits", "sits_prefix_cache_cross_tenant_hits",
           "sits_prefix_cache_shared_hits", "sits_preemptions")),
        *((CounterMetricFamily, name, SPEC_LABELS) for name in
          ("sits_spec_decode_draft_tokens", "sits_spec_decode_accepted_tokens", "sits_engine_steps",
           "sits_engine_cpu_seconds")),
        (CounterMetricFamily, "sits_prefix_cache_tier_hits", TIER_LABELS),
        (GaugeMetricFamily, "sits_kv_host_blocks_used", LABELS),
        (GaugeMetricFamily, "sits_kv_host_blocks_total", SPEC_LABELS),
        *((CounterMetricFamily, name, SPEC_LABELS) for name, _, _ in HOST_TIER_COUNTERS),
    )

    def _families(self, stats: EngineStats) -> Iterator[Metric]:
        total_blocks = max(stats.kv_blocks_total, 1)
        used = {tenant: blocks / total_blocks
                for tenant, blocks in _by_tenant(stats.kv_blocks_used_by_tenant, stats.kv_blocks_used).items()}
        yield self._per_tenant(GaugeMetricFamily, "sits_requests_running", "Sequences running in the engine.",
                               _by_tenant(stats.running_by_tenant, stats.num_running))
        yield self._per_tenant(GaugeMetricFamily, "sits_requests_waiting",
                               "Sequences waiting in the engine (queued or preempted).",
                               _by_tenant(stats.waiting_by_tenant, stats.num_waiting))
        yield self._per_tenant(GaugeMetricFamily, "sits_kv_cache_usage_ratio",
                               "Fraction of KV-cache blocks held by sequences (0-1).", used)
        yield from self._prefix_families(stats)
        yield from self._tier_families(stats)
        yield self._per_tenant(CounterMetricFamily, "sits_preemptions",
                               "Times a running sequence lost its KV blocks to make room.",
                               _by_tenant(stats.preemptions_by_tenant, stats.num_preemptions))
        yield self._single(CounterMetricFamily, "sits_engine_steps", "Engine steps that ran the model.",
                           stats.num_steps)
        yield self._single(CounterMetricFamily, "sits_engine_cpu_seconds",
                           "CPU seconds of the engine's process (the engine core process under sits serve), "
                           "all its threads.", stats.cpu_seconds)
        spec = stats.spec_decode
        if spec is not None:  # only while speculative decoding is on (engine-wide, as vLLM's spec_decode_*)
            yield self._single(CounterMetricFamily, "sits_spec_decode_draft_tokens",
                               "Speculative draft tokens proposed.", spec.num_draft_tokens)
            yield self._single(CounterMetricFamily, "sits_spec_decode_accepted_tokens",
                               "Speculative draft tokens the target model accepted.", spec.num_accepted_tokens)

    def _prefix_families(self, stats: EngineStats) -> Iterator[Metric]:
        prefix = stats.prefix_cache_by_tenant

        def per_tenant(field: str, engine_total: float) -> dict[str, float]:
            return _by_tenant({tenant: getattr(counts, field) for tenant, counts in prefix.items()}, engine_total)

        yield self._per_tenant(CounterMetricFamily, "sits_prefix_cache_queries",
                               "Prompt tokens looked up in the prefix cache.",
                               per_tenant("queries", stats.prefix_cache_queries))
        yield self._per_tenant(CounterMetricFamily, "sits_prefix_cache_hits",
                               "Prompt tokens served from the prefix cache.", per_tenant("hits", stats.prefix_cache_hits))
        yield self._per_tenant(CounterMetricFamily, "sits_prefix_cache_cross_tenant_hits",
                               "Prompt tokens served from KV blocks another tenant computed, outside the "
                               "shared-prefix pool (tenant isolation: stays 0).", per_tenant("cross_tenant_hits", 0))
        yield self._per_tenant(CounterMetricFamily, "sits_prefix_cache_shared_hits",
                               "Prompt tokens served from another tenant's blocks through the shared-prefix pool.",
                               per_tenant("shared_hits", 0))

    def _tier_families(self, stats: EngineStats) -> Iterator[Metric]:
        """Prefix-cache hits by tier (`gpu`, `host`; their sum is sits_prefix_cache_hits_total, which
        keeps its meaning) and, with --host-kv-cache-gb, the host tier's blocks and copies."""
        hits = CounterMetricFamily("sits_prefix_cache_tier_hits",
                                   "Prompt tokens served from the prefix cache, by the tier that held them.",
                                   labels=TIER_LABELS)
        prefix = stats.prefix_cache_by_tenant
        host_hits = stats.prefix_cache_host_hits
        per_tenant = ({tenant: (counts.hits - counts.host_hits, counts.host_hits) for tenant, counts in prefix.items()}
                      if prefix else {DEFAULT_TENANT: (stats.prefix_cache_hits - host_hits, host_hits)})
        per_tenant.setdefault(DEFAULT_TENANT, (0, 0))
        for tenant, (gpu, host) in sorted(per_tenant.items()):
            hits.add_metric([self._model, tenant, self._track, "gpu"], float(gpu))
            hits.add_metric([self._model, tenant, self._track, "host"], float(host))
        yield hits
        host_kv = stats.host_kv
        if host_kv is None:
            return
        yield self._per_tenant(GaugeMetricFamily, "sits_kv_host_blocks_used",
                               "Host KV tier blocks a tenant holds (cached, or being written).",
                               _by_tenant(host_kv.blocks_by_tenant, 0))
        yield self._single(GaugeMetricFamily, "sits_kv_host_blocks_total", "Blocks in the host KV tier.",
                           host_kv.blocks_total)
        for name, field, doc in HOST_TIER_COUNTERS:
            yield self._single(CounterMetricFamily, name, doc, getattr(host_kv, field))


def _by_tenant(per_tenant: dict[str, int], total: float) -> dict[str, float]:
    """The per-tenant split, with "default" present (holding the total when no split is given)."""
    values: dict[str, float] = dict(per_tenant) if per_tenant else {DEFAULT_TENANT: total}
    values.setdefault(DEFAULT_TENANT, 0)
    return values


class ServerMetrics:
    """The server's metrics, in a registry of its own."""

    def __init__(self, model: str, track: str, stats_source: Callable[[], EngineStats]) -> None:
        self.model = model
        self.track = track
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.request_latency = Histogram(
            "sits_request_latency_seconds", "End-to-end latency of successful requests, arrival to last byte.",
            LABELS, buckets=LATENCY_BUCKETS, registry=registry)
        self.time_to_first_token = Histogram(
            "sits_time_to_first_token_seconds", "Arrival to the first generated token, per engine request.",
            LABELS, buckets=LATENCY_BUCKETS, registry=registry)
        self.time_per_output_token = Histogram(
            "sits_time_per_output_token_seconds", "Mean gap between generated tokens after the first.",
            LABELS, buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(
            "sits_prompt_tokens", "Prompt tokens of accepted requests.", LABELS, registry=registry)
        self.generation_tokens = Counter(
            "sits_generation_tokens", "Tokens generated.", LABELS, registry=registry)
        self.requests = Counter(
            "sits_requests", "Completed API requests by HTTP status (499: the client went away).",
            (*LABELS, "status"), registry=registry)
        registry.register(EngineStatsCollector(stats_source, model, track))
        # process_cpu_seconds_total, process_resident_memory_bytes, ...: this (the API server's) process, as
        # prometheus_client's default registry exports them (Linux; nothing elsewhere).
        ProcessCollector(registry=registry)

    def register(self, collector: Any) -> None:
        """Add a custom collector (e.g. the tenancy layer's) to this server's registry."""
        self.registry.register(collector)

    def observe_request(self, tenant: str, status: int, latency_s: float) -> None:
        """One finished API request; latency only counts for successful ones (what users waited for)."""
        self.requests.labels(self.model, tenant, self.track, str(status)).inc()
        if status == 200:
            self.request_latency.labels(self.model, tenant, self.track).observe(latency_s)

    def observe_generation(self, tenant: str, *, prompt_tokens: int, output_tokens: int,
                           ttft_s: float | None, tpot_s: float | None) -> None:
        """One engine request's figures: token counts, time to first token, mean time per later token."""
        labels = (self.model, tenant, self.track)
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.generation_tokens.labels(*labels).inc(output_tokens)
        if ttft_s is not None:
            self.time_to_first_token.labels(*labels).observe(ttft_s)
        if tpot_s is not None:
            self.time_per_output_token.labels(*labels).observe(tpot_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
