"""The scheduler over a real KV-cache manager: budgets, chunked prefill, preemption, abort, stops.

The model's part is played by a token source that "samples" a fixed token for every sequence
that reached its end, so each test controls exactly what the scheduler sees.
"""

from __future__ import annotations

from sits.runtime.config import SchedulerConfig
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.scheduler import Scheduler
from sits.runtime.engine.scheduler_output import ModelRunnerOutput, SampledToken, SchedulerOutput
from sits.runtime.engine.scheduling_policy import PriorityPolicy, WaitingQueue
from sits.runtime.engine.sequence import Sequence, SequenceStatus

EOS = 2
NEXT_TOKEN = 7


def make_scheduler(num_blocks=64, block_size=4, max_tokens=64, max_seqs=8, chunked=True, max_model_len=256,
                   prefix_caching=True, policy=None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, enable_chunked_prefill=chunked)
    cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(config, cache, max_model_len, eos_token_ids=[EOS], policy=policy)


_order = iter(range(1_000_000))


def make_seq(seq_id, prompt_len, *, max_tokens=8, priority=0, arrival=None, first_token=None, **params) -> Sequence:
    """A sequence whose prompt is distinct from every other's unless first_token says otherwise."""
    order = next(_order)
    first_token = 100 * order + 10 if first_token is None else first_token
    return Sequence(
        seq_id, seq_id, 0, list(range(first_token, first_token + prompt_len)),
        SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens,
        arrival_time=float(order) if arrival is None else arrival, priority=priority, arrival_order=order,
    )


def run_step(scheduler: Scheduler, token: int | dict[str, int] = NEXT_TOKEN) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {
        s.seq_id: SampledToken(token.get(s.seq_id, NEXT_TOKEN) if isinstance(token, dict) else token)
        for s in output.scheduled if s.samples
    }
    scheduler.update_from_output(output, ModelRunnerOutput(sampled))
    return output


def shares(output: SchedulerOutput) -> dict[str, int]:
    return {s.seq_id: s.num_new_tokens for s in output.scheduled}


def test_prompts_are_batched_within_the_token_budget():
    scheduler = make_scheduler(max_tokens=20)
    for i in range(3):
        scheduler.add_request(make_seq(f"s{i}", 8))
    first = run_step(scheduler)
    assert shares(first) == {"s0": 8, "s1": 8, "s2": 4}  # the third prompt gets a 4-token chunk
    assert first.num_batched_tokens == 20
    assert [s.samples for s in first.scheduled] == [True, True, False]
    second = run_step(scheduler)
    # Decodes first, then the rest of the chunked prompt.
    assert list(shares(second).items()) == [("s0", 1), ("s1", 1), ("s2", 4)]
    assert second.scheduled[0].start_position == 8 and second.scheduled[0].token_ids == [NEXT_TOKEN]


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_seqs=2)
    for i in range(3):
        scheduler.add_request(make_seq(f"s{i}", 3))
    assert set(shares(run_step(scheduler))) == {"s0", "s1"}
    assert scheduler.stats().num_running == 2 and scheduler.stats().num_waiting == 1


def test_long_prompt_is_prefilled_in_chunks_beside_decodes():
    scheduler = make_scheduler(max_tokens=6)
    scheduler.add_request(make_seq("short", 2, max_tokens=20))
    scheduler.add_request(make_seq("long", 15))
    assert shares(run_step(scheduler)) == {"short": 2, "long": 4}
    assert list(shares(run_step(scheduler)).items()) == [("short", 1), ("long", 5)]
    assert list(shares(run_step(scheduler)).items()) == [("short", 1), ("long", 5)]
    last = run_step(scheduler)
    assert list(shares(last).items()) == [("short", 1), ("long", 1)]
    long_seq = scheduler.get_sequence("long")
    assert long_seq.num_output_tokens == 1 and long_seq.num_computed_tokens == 15


def test_without_chunked_prefill_a_prompt_waits_for_room_unless_it_can_never_fit():
    scheduler = make_scheduler(max_tokens=10, chunked=False)
    scheduler.add_request(make_seq("a", 6))
    scheduler.add_request(make_seq("b", 6))
    assert shares(run_step(scheduler)) == {"a": 6}  # b does not fit whole in the 4 left
    assert shares(run_step(scheduler)) == {"a": 1, "b": 6}

    lone = make_scheduler(max_tokens=10, chunked=False)
    lone.add_request(make_seq("huge", 25))
    assert shares(run_step(lone)) == {"huge": 10}  # never fits whole: chunked rather than starved


def test_preemption_frees_the_latest_lowest_priority_sequence_and_everyone_finishes():
    # 6 blocks of 4 tokens; two sequences of 8 prompt + 8 output tokens need 8 blocks together.
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    scheduler.add_request(make_seq("old", 8, max_tokens=8))
    scheduler.add_request(make_seq("new", 8, max_tokens=8))
    preempted: list[str] = []
    for _ in range(60):
        if not scheduler.has_unfinished_requests():
            break
        output = run_step(scheduler)
        preempted += output.preempted_seq_ids
        assert scheduler.kv_cache.pool.num_used_blocks <= 6
    assert not scheduler.has_unfinished_requests()
    assert preempted and preempted[0] == "new"
    assert scheduler.stats().num_preemptions == len(preempted)
    assert scheduler.kv_cache.pool.num_used_blocks == 0


def test_the_lower_priority_sequence_is_preempted_even_if_it_arrived_first():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    low, high = make_seq("low", 8, priority=0), make_seq("high", 8, priority=2)
    scheduler.add_request(low)
    scheduler.add_request(high)
    preempted: list[str] = []
    while scheduler.has_unfinished_requests() and not preempted:
        preempted = run_step(scheduler).preempted_seq_ids
    assert preempted == ["low"]
    assert low.status is SequenceStatus.WAITING and low.num_computed_tokens == 0 and low.num_preemptions == 1
    assert high.status is SequenceStatus.RUNNING


def test_a_preempted_sequence_recomputes_its_tokens_and_hits_its_own_cached_blocks():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    scheduler.add_request(make_seq("a", 8))
    scheduler.add_request(make_seq("b", 8))
    victim = None
    while victim is None:
        output = run_step(scheduler)
        victim = output.preempted_seq_ids[0] if output.preempted_seq_ids else None
    seq = scheduler.get_sequence(victim)
    tokens_before = list(seq.all_token_ids)
    while seq.status is SequenceStatus.WAITING:
        output = run_step(scheduler)
    resumed = next(s for s in output.scheduled if s.seq_id == victim)
    assert resumed.token_ids == tokens_before[resumed.start_position:]  # prompt and output tokens recomputed
    assert seq.all_token_ids[: len(tokens_before)] == tokens_before


def test_abort_frees_blocks_at_once():
    scheduler = make_scheduler()
    scheduler.add_request(make_seq("a", 10))
    scheduler.add_request(make_seq("b", 5))
    run_step(scheduler)
    assert scheduler.kv_cache.pool.num_used_blocks == 5
    finished = scheduler.finish_requests(["a", "b", "unknown"], SequenceStatus.FINISHED_ABORTED)
    assert [s.seq_id for s in finished] == ["a", "b"]
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in finished)
    assert scheduler.kv_cache.pool.num_used_blocks == 0 and not scheduler.has_unfinished_requests()
    assert set(scheduler.schedule().finished_seq_ids) == {"a", "b"}  # the runner drops their state


def test_stop_reasons_and_statuses():
    scheduler = make_scheduler()
    seqs = {
        "eos": make_seq("eos", 3),
        "stop_id": make_seq("stop_id", 3, stop_token_ids=[99]),
        "length": make_seq("length", 3, max_tokens=2),
        "ignore": make_seq("ignore", 3, ignore_eos=True, max_tokens=3),
        "min": make_seq("min", 3, min_tokens=2),
    }
    for seq in seqs.values():
        scheduler.add_request(seq)
    tokens = {"eos": EOS, "stop_id": 99, "ignore": EOS, "min": EOS, "length": 5}
    for _ in range(4):
        run_step(scheduler, tokens)
    assert seqs["eos"].status is SequenceStatus.FINISHED_STOPPED and seqs["eos"].num_output_tokens == 1
    assert seqs["stop_id"].stop_reason == 99 and seqs["stop_id"].status is SequenceStatus.FINISHED_STOPPED
    assert seqs["length"].status is SequenceStatus.FINISHED_LENGTH and seqs["length"].num_output_tokens == 2
    assert seqs["ignore"].status is SequenceStatus.FINISHED_LENGTH and seqs["ignore"].output_token_ids == [EOS] * 3
    # EOS before min_tokens is not a stop (the sampler masks it; the scheduler does not stop on it).
    assert seqs["min"].status is SequenceStatus.FINISHED_STOPPED and seqs["min"].num_output_tokens == 2


def test_max_model_len_ends_a_sequence():
    scheduler = make_scheduler(max_model_len=6)
    seq = make_seq("s", 4, max_tokens=100)
    scheduler.add_request(seq)
    for _ in range(3):
        run_step(scheduler)
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 6


def test_priority_policy_admits_higher_priority_first():
    scheduler = make_scheduler(max_seqs=1, policy=PriorityPolicy())
    scheduler.add_request(make_seq("low", 3, priority=0))
    scheduler.add_request(make_seq("high", 3, priority=3))
    assert set(shares(run_step(scheduler))) == {"high"}

    fcfs = make_scheduler(max_seqs=1)
    fcfs.add_request(make_seq("low", 3, priority=0))
    fcfs.add_request(make_seq("high", 3, priority=3))
    assert set(shares(run_step(fcfs))) == {"low"}


def test_siblings_wait_for_the_first_prompt_then_share_its_blocks():
    scheduler = make_scheduler(block_size=4)
    prompt_len = 10  # two full blocks shareable
    children = [make_seq(f"r#{i}", prompt_len, first_token=10) for i in range(3)]
    for index, child in enumerate(children):
        child.index, child.request_id = index, "r"
        child.sibling_ids = tuple(c.seq_id for c in children if c is not child)
        scheduler.add_request(child)
    assert scheduler.stats().num_waiting == 3
    assert shares(run_step(scheduler)) == {"r#0": 10}
    second = run_step(scheduler)
    assert shares(second) == {"r#0": 1, "r#1": 2, "r#2": 2}  # 8 prompt tokens hit the cache
    table0 = scheduler.kv_cache.block_ids("r#0")
    assert scheduler.kv_cache.block_ids("r#1")[:2] == table0[:2] == scheduler.kv_cache.block_ids("r#2")[:2]
    assert children[1].num_cached_prompt_tokens == 8
    stats = scheduler.stats()
    assert stats.prefix_cache_hits == 16 and stats.prefix_cache_queries == 30


def test_aborting_a_request_releases_its_held_siblings_too():
    scheduler = make_scheduler(block_size=4)
    children = [make_seq(f"r#{i}", 10, first_token=10) for i in range(3)]
    for index, child in enumerate(children):
        child.index, child.request_id = index, "r"
        child.sibling_ids = tuple(c.seq_id for c in children if c is not child)
        scheduler.add_request(child)
    run_step(scheduler)
    scheduler.finish_requests(["r#0", "r#1", "r#2"], SequenceStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and len(scheduler.waiting) == 0
    assert scheduler.stats().num_waiting == 0 and scheduler.kv_cache.pool.num_used_blocks == 0


def test_stats_snapshot():
    scheduler = make_scheduler(num_blocks=10)
    scheduler.add_request(make_seq("a", 5))
    seq = make_seq("b", 2)
    seq.tenant = "acme"
    scheduler.add_request(seq)
    run_step(scheduler)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 0)
    assert stats.kv_blocks_total == 10 and stats.kv_blocks_used == 3
    assert stats.running_by_tenant == {"default": 1, "acme": 1}
    assert stats.kv_blocks_used_by_tenant == {"default": 2, "acme": 1}


class ShortestPromptFirst(WaitingQueue):
    """A waiting queue unlike the default, to show the seam a fair queue plugs into."""

    def __init__(self) -> None:
        self.items: list[Sequence] = []

    def push(self, seq):
        self.items.append(seq)

    def push_front(self, seq):
        self.items.insert(0, seq)

    def peek(self):
        return min(self.items, key=lambda s: s.num_prompt_tokens)

    def pop(self):
        head = self.peek()
        self.items.remove(head)
        return head

    def remove(self, seq):
        if seq in self.items:
            self.items.remove(seq)
            return True
        return False

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(list(self.items))


def test_the_waiting_queue_is_pluggable():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64)
    scheduler = Scheduler(config, KVCacheManager(64, 4), 256, [EOS], waiting_queue=ShortestPromptFirst())
    scheduler.add_request(make_seq("long", 9))
    scheduler.add_request(make_seq("short", 3))
    assert set(shares(run_step(scheduler))) == {"short"}
