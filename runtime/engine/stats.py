"""The engine's figures, built when asked: by a /metrics scrape, `sits serve`'s startup line, a test.

Nothing here runs per step. The counters (`num_*` totals, prefix-cache and speculative figures)
are incremented where their event happens, each in the one object that owns it (the engine
counts requests and tokens, the scheduler preemptions, the KV cache its prefix lookups, the block
pool its evictions, the speculator its drafts); the gauges (running, waiting, blocks used, each
tenant's share of them) are read off the scheduler and the pool. `LLMEngine.stats()` gathers both
into one frozen `EngineStats` on the engine's thread, between steps, and only when someone asks:
`AsyncEngine.stats()` and `MultiprocessEngineClient.stats()` hand the ask to the step loop and wait
for its answer through a `StatsAnswers` (see there for why an ask, and not a snapshot pushed
every N ms). Metrics read these frozen snapshots; they never reach into the scheduler or the KV
cache. Counters only grow over the engine's life, as Prometheus counters expect. (One tenant's
prefix-cache figures, `PrefixCacheCounts`, close the module.)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sits.runtime.engine.host_tier import HostTierStats

# How long an ask waits for the step loop (a step in flight on a loaded CPU can take seconds);
# after that the caller gets the latest figures built instead of an error.
STATS_WAIT_S = 5.0


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
class EngineStats:
    """Everything a metrics collector needs, as of `timestamp` (time.time(), seconds).

    Built in two parts, each field by its one owner: `Scheduler.stats()` fills the queues, the KV
    cache and their counters (the engine's own counters stay 0 there), and `LLMEngine.stats()`
    adds the engine's request and token counters to that (`dataclasses.replace`).

    Attributes:
        num_running, num_waiting: sequences running / waiting, preempted and held siblings
            included (a request with n completions counts n).
        kv_blocks_total, kv_blocks_used: paged-cache blocks, and those referenced by sequences.
        kv_blocks_cached: blocks findable by prefix hash (used or evictable).
        kv_block_size: tokens per block.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in / served from the
            prefix cache (cumulative, in tokens).
        prefix_cache_host_hits: of prefix_cache_hits, tokens copied back from the host tier.
        num_preemptions: times a running sequence lost its KV and recomputes (cumulative).
        num_evictions: cached blocks whose hash was dropped to reuse them (cumulative).
        *_by_tenant: the same per tenant (preemptions by the tenant that lost its KV).
        prefix_cache_by_tenant: each tenant's prefix-cache figures, cross-tenant hits included.
        spec_decode: speculative decoding's drafts proposed / accepted; None when it is off.
        host_kv: the host tier's figures (--host-kv-cache-gb); None when it is off.
        num_requests: client requests in the engine (unfinished).            [engine]
        num_finished: requests finished, aborted ones included (cumulative). [engine]
        num_aborted: of those, aborted (cumulative).                         [engine]
        num_prompt_tokens, num_generation_tokens: tokens taken in and produced (cumulative). [engine]
        num_steps: engine steps that ran the model (cumulative).             [engine]
        cpu_seconds: CPU time of the process the engine runs in, all its threads (cumulative;
            `time.process_time()`: the engine process's own under `sits serve`). [engine]
    """

    timestamp: float = field(default_factory=time.time)
    num_requests: int = 0
    num_steps: int = 0
    cpu_seconds: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_running: int = 0
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    num_waiting: int = 0
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_block_size: int = 0
    kv_blocks_used_by_tenant: dict[str, int] = field(default_factory=dict)
    prefix_cache_by_tenant: dict[str, PrefixCacheCounts] = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_hits: int = 0
    host_kv: HostTierStats | None = None
    spec_decode: SpecDecodeCounts | None = None
    preemptions_by_tenant: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_evictions: int = 0
    num_finished: int = 0
    num_aborted: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """kv_blocks_used / kv_blocks_total, 0..1 (0 without a cache)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the cache, 0..1."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class StatsAnswers:
    """Asks for `EngineStats` across a thread or a process boundary, and their answers.

    The asking side takes a numbered ticket (`ask`), hands it to the step loop (a command on the
    engine's thread, a `StatsRequest` down the engine process's pipe) and waits (`wait`); the step
    loop builds one snapshot between two steps and answers every ticket up to the last one it read
    (`answer`): tickets only grow and both channels keep their order, so one build serves every
    ask that was waiting.

    Why an ask answered between steps, and not a snapshot the loop pushes every N ms: an ask costs
    the step loop nothing while nobody looks (Prometheus scrapes every 15-30 s; a push would build
    and pickle a snapshot every N ms for nothing), and what it returns is no older than the step in
    flight, where a pushed one would be up to N ms old, so a caller that reads the figures right
    after an event sees the event. The price is the wait: at most the step in flight (milliseconds
    on a GPU) plus a pipe round trip (~0.1 ms), measured in benchmarks/RESULTS.md; /metrics
    waits on a worker thread, never on the event loop. A step that overruns STATS_WAIT_S gets the
    caller the latest figures built instead.

    Thread-safe. Args: initial: the figures returned until a first answer (the engine as loaded).
    """

    def __init__(self, initial: EngineStats) -> None:
        self._cond = threading.Condition()
        self._latest = initial
        self._asked = 0  # tickets handed out
        self._answered = 0  # every ticket up to this one has its answer
        self._closed = False  # the step loop is gone: no answer will come

    @property
    def latest(self) -> EngineStats:
        """The figures of the latest answer (no wait)."""
        return self._latest

    @property
    def pending(self) -> int:
        """The last ticket handed out that has no answer yet (0: none)."""
        with self._cond:
            return self._asked if self._asked > self._answered else 0

    def ask(self) -> int:
        """A new ticket (1, 2, ...); hand it to the step loop, then `wait` for it."""
        with self._cond:
            self._asked += 1
            return self._asked

    def answer(self, through: int, stats: EngineStats) -> None:
        """The step loop's figures, answering every ticket up to `through`."""
        with self._cond:
            self._latest = stats
            self._answered = max(self._answered, through)
            self._cond.notify_all()

    def close(self) -> None:
        """The step loop will answer no more: every wait returns the latest figures now."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, ticket: int, timeout_s: float = STATS_WAIT_S) -> EngineStats:
        """The answer to `ticket` (or a later one); the latest figures once closed or after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._answered < ticket and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._latest


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

