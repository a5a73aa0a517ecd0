"""Snapshots of the engine's state, for metrics and health endpoints.

Metrics read these frozen snapshots; they never reach into the scheduler or the KV cache. The
counters (`num_*` totals) only grow over the engine's life, as Prometheus counters expect.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sits.runtime.engine.host_tier import HostTierStats


@dataclass
class PrefixCacheCounts:
    """One tenant's prefix-cache figures, in prompt tokens (cumulative).

    Attributes:
        queries: prompt tokens looked up.
        hits: of those, served from the cache.
        cross_tenant_hits: hits on blocks another tenant computed, outside the shared-prefix pool
            (0 when salts isolate tenants).
        shared_hits: hits on blocks another tenant computed through the shared-prefix pool.
        host_hits: of the hits, tokens copied back from the host tier (the rest were on the GPU).
    """

    queries: int = 0
    hits: int = 0
    cross_tenant_hits: int = 0
    shared_hits: int = 0
    host_hits: int = 0


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's cumulative figures: draft tokens proposed and, of those, accepted
    by the target model (vLLM's spec_decode num_draft_tokens / num_accepted_tokens)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts, 0..1 (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's and the KV cache's state after a step.

    Attributes:
        num_running, num_waiting: sequences (a request with n completions counts n).
        kv_blocks_total, kv_blocks_used: blocks in the cache and referenced by sequences.
        kv_blocks_cached: blocks findable by prefix hash (used or evictable).
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / found (cumulative).
        num_preemptions: times a running sequence lost its KV to make room (cumulative).
        num_evictions: cached blocks whose hash was dropped to reuse them (cumulative).
        *_by_tenant: the same per tenant (preemptions by the tenant that lost its KV).
        prefix_cache_by_tenant: each tenant's prefix-cache figures, cross-tenant hits included.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_block_size: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_evictions: int = 0
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    kv_blocks_used_by_tenant: dict[str, int] = field(default_factory=dict)
    preemptions_by_tenant: dict[str, int] = field(default_factory=dict)
    prefix_cache_by_tenant: dict[str, PrefixCacheCounts] = field(default_factory=dict)
    spec_decode: SpecDecodeCounts | None = None  # speculative decoding's figures; None when off
    prefix_cache_host_hits: int = 0  # of prefix_cache_hits, tokens copied back from the host tier
    host_kv: HostTierStats | None = None  # the host tier (--host-kv-cache-gb); None when off


@dataclass(frozen=True)
class EngineStats:
    """Everything a metrics collector needs, as of `timestamp` (time.time(), seconds).

    Attributes:
        num_running, num_waiting: sequences running / waiting (incl. preempted).
        num_requests: client requests in the engine (unfinished).
        kv_blocks_total, kv_blocks_used: paged-cache blocks, and those held by sequences.
        kv_cache_usage: kv_blocks_used / kv_blocks_total, 0..1.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in / served from the
            prefix cache (cumulative, in tokens).
        num_preemptions: sequences that lost their KV and recompute (cumulative).
        num_finished: requests finished, aborted ones included (cumulative).
        num_aborted: of those, aborted (cumulative).
        num_prompt_tokens, num_generation_tokens: tokens taken in and produced (cumulative).
        num_steps: engine steps that ran the model (cumulative).
        *_by_tenant, prefix_cache_by_tenant: as in SchedulerStats.
        spec_decode: speculative decoding's drafts proposed / accepted; None when it is off.
    """

    timestamp: float = field(default_factory=time.time)
    num_running: int = 0
    num_waiting: int = 0
    num_requests: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_block_size: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_evictions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    kv_blocks_used_by_tenant: dict[str, int] = field(default_factory=dict)
    preemptions_by_tenant: dict[str, int] = field(default_factory=dict)
    prefix_cache_by_tenant: dict[str, PrefixCacheCounts] = field(default_factory=dict)
    spec_decode: SpecDecodeCounts | None = None  # speculative decoding's figures; None when off
    prefix_cache_host_hits: int = 0  # of prefix_cache_hits, tokens copied back from the host tier
    host_kv: HostTierStats | None = None  # the host tier (--host-kv-cache-gb); None when off

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the cache, 0..1."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
