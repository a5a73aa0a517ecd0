"""Continuous batching with chunked prefill and preemption by recompute.

Each step fills a budget of `max_num_batched_tokens` new tokens and `max_num_seqs` sequences:
  1. running sequences that decode (one token each), in policy order;
  2. running sequences still prefilling (the next chunk of their prompt);
  3. waiting sequences, in admission order, each starting after its cached prefix.
The decodes' latency budget (`max_prefill_tokens_with_decodes`, as SGLang's chunked-prefill size
and vLLM's long-prefill threshold bound it): in a step that runs decodes (at least
`prefill_cap_min_decodes` of them), 2 and 3 together get at most that many tokens, so a long prompt
goes in chunks instead of stalling the decodes that share its step; the oldest prefill goes first,
so every prompt still finishes.
A running sequence that cannot get a block preempts the lowest-ranked running sequence (lowest
priority, latest arrival) among those whose blocks it may take (a shard-aware eviction policy
rules out tenants within their guarantee), possibly itself: the victim's blocks are freed and it
goes back to the waiting queue to recompute its context later (its full blocks usually come back
as prefix hits). Waiting sequences are never admitted in a step that preempted, so room freed for
running sequences is not taken by new ones. When the waiting queue offers several heads (one per
tenant), a head that cannot get blocks is skipped for the next one instead of holding up all.

`schedule()` counts the tokens it schedules as computed at once, and a token a step will sample
as pending until `update_from_output` brings its id. So the next step can be scheduled before the
previous one's output is known (async scheduling): a sequence whose token is still pending decodes
it at its position with `PENDING_TOKEN_ID` as the input (the runner takes the id from the previous
step's sampled ids on the device), unless that token ends it by length. A stop found only in the
output (EOS, a stop token or string) costs that one scheduled token's compute, never an output token.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import chain

from sits.runtime.config import SchedulerConfig, SpeculativeConfig
from sits.runtime.engine.kv_cache import KVCacheManager, PrefixHit
from sits.runtime.engine.prompt_logprobs import collects_prompt_logprobs
from sits.runtime.engine.scheduler_interface import SchedulerInterface
from sits.runtime.engine.scheduler_output import (
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    SequenceUpdate,
)
from sits.runtime.engine.scheduling_policy import (
    FCFSPolicy,
    KeyedSequences,
    OrderedWaitingQueue,
    SchedulingPolicy,
    WaitingQueue,
)
from sits.runtime.engine.sequence import PENDING_TOKEN_ID, Sequence, SequenceStatus
from sits.runtime.engine.speculative import Speculator
from sits.runtime.engine.stats import EngineStats
from sits.runtime.engine.stopping import StopChecker

logger = logging.getLogger(__name__)


class Scheduler(SchedulerInterface):
    """The default scheduler.

    Args:
        config: token and sequence budgets, chunked prefill on/off.
        kv_cache: the block tables; the scheduler is its only caller.
        max_model_len, eos_token_ids: when a sequence stops (`stopping.StopChecker`: EOS, stop
            token ids, max_tokens, max_model_len, a grammar that ended).
        policy: admission and preemption order (FCFS by default).
        speculative: n-gram speculative decoding (`speculative.py`); None: off. A decode that
            speculates computes [its token + drafts] and keeps the drafts the target accepted.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        policy: SchedulingPolicy | None = None,
        waiting_queue: WaitingQueue | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config, self.kv_cache, self.max_model_len = config, kv_cache, max_model_len
        self.stops = StopChecker(eos_token_ids, max_model_len)
        self.policy = policy if policy is not None else FCFSPolicy()
        self.waiting = waiting_queue if waiting_queue is not None else OrderedWaitingQueue(self.policy)
        self._running = KeyedSequences(self.policy)  # admission-key order (a sequence's key never changes)
        # Completions 1..n-1 of a request are held by completion 0 (`Sequence.held_siblings`) until
        # it has computed (and cached) the prompt's full blocks, so they hit them instead.
        self._sequences: dict[str, Sequence] = {}  # the one index of unfinished sequences, by seq_id
        self._finished_since_step: list[Sequence] = []
        self.num_preemptions = 0
        self.preemptions_by_tenant: Counter[str] = Counter()
        self.speculator = Speculator(speculative, max_model_len) if speculative is not None else None
        cap, least = config.prefill_cap_with_decodes, max(config.prefill_cap_min_decodes, 1)
        logger.info("decode latency budget: %s", f"at most {cap} prompt tokens per step beside {least}+ decodes" if cap
                    else "off (prompts may fill a step's max_num_batched_tokens; --max-prefill-tokens-with-decodes sets one)")

    @property
    def running(self) -> list[Sequence]:
        """The running sequences in admission-key order (read it, never change it)."""
        return self._running.items

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, seq: Sequence) -> None:
        if seq.seq_id in self._sequences:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        seq.status = SequenceStatus.WAITING
        self._sequences[seq.seq_id] = seq
        leader = self._prompt_leader(seq)
        if leader is not None:
            leader.held_siblings.append(seq)
            seq.held_by = leader
        else:
            self.waiting.push(seq)

    def finish_requests(self, seq_ids: str | Iterable[str], status: SequenceStatus) -> list[Sequence]:
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if isinstance(seq_ids, str):
            seq_ids = (seq_ids,)
        finished = []
        for seq_id in seq_ids:
            seq = self._sequences.get(seq_id)
            if seq is None:
                continue
            self._finish(seq, status)
            finished.append(seq)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self._sequences)

    def get_sequence(self, seq_id: str) -> Sequence | None:
        return self._sequences.get(seq_id)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _StepPlan(self.config.max_num_batched_tokens)
        # Decodes first, then unfinished prefills; each group in admission order (running's order).
        decodes, prefills = [], []
        for seq in self.running:
            uncomputed = len(seq.all_token_ids) + seq.num_pending_tokens - seq.num_computed_tokens
            (prefills if uncomputed > 1 else decodes).append(seq)
        for seq in decodes:
            if step.budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING and seq.seq_id not in step.scheduled:
                self._schedule_running(seq, step)
        cap = self.config.prefill_cap_with_decodes
        if cap is not None and step.scheduled and len(step.scheduled) >= self.config.prefill_cap_min_decodes:
            # enough decodes run this step: bound what they wait for
            step.prefill_budget = cap
        for seq in prefills:
            if step.prefill_room == 0:
                break
            if seq.status is SequenceStatus.RUNNING and seq.seq_id not in step.scheduled:
                self._schedule_running(seq, step)
        if not step.preempted:
            self._admit_waiting(step)
        finished, self._finished_since_step = self._finished_since_step, []
        return SchedulerOutput(
            scheduled=list(step.scheduled.values()),  # insertion order: decodes, then prefills
            num_batched_tokens=self.config.max_num_batched_tokens - step.budget,
            preempted=step.preempted,
            finished=finished,
        )

    def _schedule_running(self, seq: Sequence, step: _StepPlan) -> None:
        num_new = min(seq.num_uncomputed_tokens, step.prefill_room)  # a decode's room is the whole budget
        if num_new <= 0 or (seq.num_pending_tokens and self.stops.pending_token_is_last(seq)):
            return
        drafts = self.speculator.drafts_for(seq, step.budget) if self.speculator is not None else []
        if drafts and self.kv_cache.allocate(seq, 1 + len(drafts)) is not None:
            step.add(self._scheduled(seq, 1, drafts))  # short of blocks: decode plainly (may preempt)
            return
        while True:
            if self.kv_cache.allocate(seq, num_new) is not None:
                step.add(self._scheduled(seq, num_new))
                return
            candidates = [s for s in self.running if s is seq or self.kv_cache.preemption_helps(seq, s)]
            victim = max(candidates, key=self.policy.preemption_key)
            self._preempt(victim, step)
            if victim is seq:
                return

    def _admit_waiting(self, step: _StepPlan) -> None:
        full_budget = self.config.max_num_batched_tokens
        while self.waiting and step.prefill_room > 0 and len(self.running) < self.config.max_num_seqs:
            for seq in self.waiting.heads():
                if seq.num_pending_tokens:  # preempted while its last step ran: wait for its token
                    continue
                # a sequence scoring its prompt needs every position's hidden state: no cache hits
                prefix = PrefixHit() if collects_prompt_logprobs(seq) else self.kv_cache.find_prefix(seq)
                num_new = seq.num_tokens - prefix.num_tokens
                if num_new > step.prefill_room:
                    # Without chunked prefill a prompt waits for a step with room for all of it,
                    # unless it could never fit: then it is chunked anyway rather than starved.
                    if not self.config.enable_chunked_prefill and step.budget < full_budget:
                        return
                    num_new = step.prefill_room
                if self.kv_cache.allocate(seq, num_new, prefix) is not None:
                    break
                # This head waits for blocks (admitting later ones of its queue would starve it);
                # the head of another tenant, whose shard has room, may still go.
            else:
                return
            self.waiting.take(seq)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = prefix.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = prefix.num_tokens
            self._running.insert(seq)
            step.add(self._scheduled(seq, num_new))

    # -- completions of one request share the prompt ---------------------------------------
    def _shareable_prompt_tokens(self, seq: Sequence) -> int:
        """Prompt tokens in full blocks that a sibling can hit (the last token always runs)."""
        block_size = self.kv_cache.block_size
        return (seq.num_prompt_tokens - 1) // block_size * block_size

    def _prompt_leader(self, seq: Sequence) -> Sequence | None:
        """The completion 0 that `seq` should wait for, or None to queue `seq` at once."""
        if seq.index == 0 or not seq.sibling_ids or not self.kv_cache.enable_prefix_caching:
            return None
        leader = next((self._sequences[i] for i in seq.sibling_ids if i in self._sequences), None)
        if leader is None or leader.index != 0 or leader.finished:
            return None
        if leader.num_computed_tokens >= self._shareable_prompt_tokens(seq) or leader.num_preemptions:
            return None
        return leader

    def _release_siblings(self, leader: Sequence, force: bool = False) -> None:
        """Queue the siblings held for `leader` once its prompt blocks are cached (or it left)."""
        if leader.held_siblings and (force or leader.num_computed_tokens >= self._shareable_prompt_tokens(leader)):
            held, leader.held_siblings = leader.held_siblings, []
            for sibling in held:
                sibling.held_by = None
                self.waiting.push(sibling)

    def _scheduled(self, seq: Sequence, num_new: int, drafts: list[int] | None = None) -> ScheduledSequence:
        """The step's share of `seq`; counts its tokens as computed (they are from now on being
        computed) and, when the chunk reaches the end, the token it samples as pending. `drafts`
        (a decode that speculates) follow its token and count as computed until the output says
        how many were accepted."""
        start = seq.num_computed_tokens
        end = start + num_new
        known = len(seq.all_token_ids)
        if end <= known:
            token_ids = seq.all_token_ids[start:end]
        else:  # ends with the previous step's sampled token, not on the host yet
            token_ids = seq.all_token_ids[start:known] + [PENDING_TOKEN_ID] * (end - max(start, known))
        samples = end == known + seq.num_pending_tokens
        if drafts:
            token_ids = token_ids + drafts
        seq.num_computed_tokens = end + len(drafts or ())
        if samples:
            seq.num_pending_tokens += 1
        return ScheduledSequence(
            sequence=seq,
            token_ids=token_ids,
            start_position=start,
            block_ids=seq.block_ids,
            samples=samples,
            draft_token_ids=drafts or [],
        )

    def _preempt(self, seq: Sequence, step: _StepPlan) -> None:
        """Take `seq`'s blocks (it recomputes later); the runner gives its row back this step."""
        self._running.remove(seq)
        self.kv_cache.free(seq)
        scheduled = step.remove(seq.seq_id)
        if scheduled is not None and scheduled.samples:
            seq.num_pending_tokens -= 1  # it will not sample this step after all
        step.preempted.append(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_tenant[seq.tenant] += 1
        self.waiting.push_front(seq)
        self._release_siblings(seq, force=True)

    # -- after the model ran ---------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[SequenceUpdate]:
        updates = []
        for scheduled in scheduler_output.scheduled:
            seq = scheduled.sequence
            if seq.status.finished:  # aborted, stopped by a string, or ended by an earlier token
                continue
            accepted = runner_output.accepted_drafts.get(seq.seq_id, []) if scheduled.draft_token_ids else []
            if scheduled.draft_token_ids and self.speculator is not None:  # only accepted drafts keep their KV
                seq.num_computed_tokens = scheduled.start_position + 1 + len(accepted)
                self.speculator.record(len(scheduled.draft_token_ids), len(accepted))
            if seq.status is SequenceStatus.RUNNING:  # (else preempted after this step was launched)
                self.kv_cache.cache_computed_blocks(seq)
                if seq.held_siblings:
                    self._release_siblings(seq)
            if not scheduled.samples:
                continue
            seq.num_pending_tokens -= 1
            sampled = runner_output.sampled.get(seq.seq_id)
            if sampled is None:
                continue
            appended: list[int] = []
            for token_id in [*accepted, sampled.token_id]:  # a stop inside the accepted run ends it there
                seq.append_output_token(token_id)
                appended.append(token_id)
                status, by_token = self.stops.check(seq, token_id)
                if status is not None:
                    self._finish(seq, status)
                    break
            logprobs = [sampled.logprob] if sampled.logprob is not None else None
            updates.append(SequenceUpdate(seq, appended, logprobs, finished_by_token=by_token))
        return updates

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """The one place a sequence ends: out of its queue, its blocks freed, out of the index, its
        held siblings queued; the next step hands it to the runner, which gives its row back."""
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq.held_by is not None:
            seq.held_by.held_siblings.remove(seq)
            seq.held_by = None
        else:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        seq.status = status
        del self._sequences[seq.seq_id]
        self._finished_since_step.append(seq)
        self._release_siblings(seq, force=True)

    # -- observation -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.kv_cache.pool
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + sum(1 for _ in self._held()),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=pool.num_cached_blocks,
            kv_block_size=self.kv_cache.block_size,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            prefix_cache_host_hits=self.kv_cache.prefix_cache_host_hits,
            host_kv=self.kv_cache.host_tier.stats() if self.kv_cache.host_tier is not None else None,
            num_preemptions=self.num_preemptions,
            num_evictions=pool.num_evictions,
            running_by_tenant=dict(Counter(s.tenant for s in self.running)),
            waiting_by_tenant=dict(Counter(s.tenant for s in self._waiting_sequences())),
            kv_blocks_used_by_tenant=pool.used_blocks_by_tenant(),
            preemptions_by_tenant=dict(self.preemptions_by_tenant),
            prefix_cache_by_tenant=self.kv_cache.prefix_counts_snapshot(),
            spec_decode=self.speculator.counts() if self.speculator is not None else None,
        )


    def _held(self) -> Iterator[Sequence]:
        """Sequences held for their leader (leaders are running or waiting)."""
        return (seq for leader in chain(self.running, self.waiting) for seq in leader.held_siblings)

    def _waiting_sequences(self) -> list[Sequence]:
        return list(self.waiting) + list(self._held())


class _StepPlan:
    """The batch being built: remaining token budget and what is scheduled so far."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.prefill_budget: int | None = None  # prompt tokens left under the decodes' latency budget
        self._capped: set[str] = set()  # scheduled after the latency budget was set: counted against it
        self.scheduled: dict[str, ScheduledSequence] = {}
        self.preempted: list[Sequence] = []

    @property
    def prefill_room(self) -> int:
        """Prompt tokens this step may still take: the token budget, or less under the latency budget."""
        return self.budget if self.prefill_budget is None else min(self.budget, self.prefill_budget)

    def add(self, scheduled: ScheduledSequence) -> None:
        self.scheduled[scheduled.seq_id] = scheduled
        self.budget -= scheduled.num_new_tokens
        if self.prefill_budget is not None:
            self.prefill_budget -= scheduled.num_new_tokens
            self._capped.add(scheduled.seq_id)

    def remove(self, seq_id: str) -> ScheduledSequence | None:
        scheduled = self.scheduled.pop(seq_id, None)
        if scheduled is not None:
            self.budget += scheduled.num_new_tokens
            if seq_id in self._capped:
                self._capped.discard(seq_id)
                self.prefill_budget = (self.prefill_budget or 0) + scheduled.num_new_tokens
        return scheduled
