"""One request object owns its state: a finished, aborted or preempted request leaves no trace.

The tiny random Llama (real loading, SmolLM2's tokenizer) runs requests that use every kind of
per-sequence state the engine keeps (KV blocks, persistent-batch rows, seeded generators, logit
bias, token masks, grammar matchers, prompt logprobs, held siblings of n > 1) in a cache small
enough that they preempt one another; then every index is empty and every block is back in the pool.
"""

from __future__ import annotations

import pytest

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.runner import ModelRunner
from sits.runtime.engine.sequence import Sequence, SequenceStatus
from sits.runtime.engine.structured_output import JSON_OBJECT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PreemptionWatchingRunner(ModelRunner):
    """The engine's runner, checking at each launch that the sequences preempted by this step's
    schedule hold nothing any more once their rows are given back."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.preempted: list[Sequence] = []
        self.kv_cache = None  # set by the test once the engine exists

    def launch(self, scheduler_output):
        pending = super().launch(scheduler_output)
        for seq in scheduler_output.preempted:
            self.preempted.append(seq)
            assert seq.status is SequenceStatus.WAITING
            assert seq.blocks == [] and seq.block_ids == [] and seq.num_cached_blocks == 0
            assert seq.batch_row is None and seq.num_computed_tokens == 0
            assert not self.kv_cache.holds(seq.seq_id)
        return pending


def make_engine(loaded, async_scheduling: bool, num_blocks: int) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=96),
                          cache=CacheConfig(block_size=8, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
                          async_scheduling=async_scheduling)
    engine = LLMEngine.from_loaded(loaded, config, runner_factory=PreemptionWatchingRunner)
    engine.runner.kv_cache = engine.kv_cache
    return engine


def add_mixed_requests(engine: LLMEngine, prompt: list[int]) -> list[str]:
    """Requests that between them hold every kind of per-sequence state."""
    requests = {
        "seeded-n3": SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
        "biased": SamplingParams(temperature=0.0, max_tokens=20, logit_bias={5: 3.0}, ignore_eos=True),
        "masked": SamplingParams(temperature=0.8, max_tokens=20, allowed_token_ids=list(range(40, 400)),
                                 ignore_eos=True),
        "penalized": SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
        "scored": SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2, ignore_eos=True),
        "json": SamplingParams(temperature=0.0, max_tokens=16, structured_output=JSON_OBJECT),
    }
    for offset, (request_id, params) in enumerate(requests.items()):
        engine.add_request(request_id, [t + offset for t in prompt], params)
    return list(requests)


def assert_no_trace(engine: LLMEngine, rows_too: bool = True) -> None:
    """Nothing of any request is left: indexes, queues, matchers, blocks (and rows, once a step
    has handed the finished sequences to the runner)."""
    scheduler, kv = engine.scheduler, engine.kv_cache
    assert not engine.has_unfinished_requests() and engine.num_unfinished_requests == 0
    assert engine._requests == {} and engine._num_unscheduled == 0 and engine._num_history == 0
    assert not scheduler.has_unfinished_requests() and scheduler.get_sequence("seeded-n3#1") is None
    assert scheduler.running == [] and len(scheduler.waiting) == 0
    assert scheduler.stats().num_waiting == 0 and scheduler.stats().num_running == 0
    assert kv.num_holders == 0 and kv.block_ids("biased") == []
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_free_blocks == kv.num_blocks
    assert not engine.structured_outputs and len(engine.structured_outputs) == 0
    if rows_too:
        assert engine.runner.input_batch.num_rows_in_use == 0
        assert not engine.runner.input_batch._extra_rows


def run_to_end(engine: LLMEngine, request_ids: list[str]) -> dict:
    finals = {}
    for _ in range(800):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finals) == set(request_ids)
    return finals


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_finished_and_preempted_requests_leave_no_trace(tiny, async_scheduling):
    # 12 blocks of 8 tokens hold three ~40-token sequences at most: the eight preempt one another.
    engine = make_engine(tiny, async_scheduling, num_blocks=12)
    request_ids = add_mixed_requests(engine, list(range(100, 124)))
    sequences = [seq for request in engine._requests.values() for seq in request.sequences]
    assert sum(seq.grammar is not None for seq in sequences) == 1 == len(engine.structured_outputs)
    run_to_end(engine, request_ids)
    assert engine.runner.preempted, "the cache was meant to be too small for every request at once"
    assert_no_trace(engine, rows_too=False)
    engine.step()  # the finished sequences reach the runner, which gives their rows back
    assert_no_trace(engine)
    for seq in sequences:  # what each sequence held went with it
        assert seq.finished and seq.blocks == [] and seq.batch_row is None and seq.grammar is None
        assert seq.held_siblings == [] and seq.held_by is None
    assert any(seq.generator is not None for seq in sequences)  # the seeded ones drew from their own


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_aborted_requests_leave_no_trace_whenever_they_are_aborted(tiny, async_scheduling):
    engine = make_engine(tiny, async_scheduling, num_blocks=12)
    request_ids = add_mixed_requests(engine, list(range(200, 224)))
    leader, *siblings = engine._requests["seeded-n3"].sequences
    assert leader.held_siblings == siblings and all(seq.held_by is leader for seq in siblings)
    engine.abort_request("seeded-n3")  # waiting, completions 1 and 2 held for completion 0
    assert leader.held_siblings == [] and all(seq.held_by is None for seq in siblings)
    done = set()
    for _ in range(6):  # the others hold blocks, rows and matchers now
        done |= {output.request_id for output in engine.step() if output.finished}
    assert engine.kv_cache.num_holders > 0 and engine.runner.input_batch.num_rows_in_use > 0
    finals = engine.abort_request(request_ids)
    assert {final.request_id for final in finals} == set(request_ids) - {"seeded-n3"} - done
    assert all(final.finished for final in finals)
    assert_no_trace(engine, rows_too=False)  # blocks back at once
    engine.step()
    assert_no_trace(engine)
    assert engine.stats().num_aborted == len(request_ids) - len(done)
    # the engine serves on: a new request under a used id runs to the end
    engine.add_request("json", list(range(10, 30)), SamplingParams(max_tokens=5, structured_output=JSON_OBJECT))
    run_to_end(engine, ["json"])
    engine.step()
    assert_no_trace(engine)
