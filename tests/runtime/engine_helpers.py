"""Driving the real engine in tests: a runner that counts the input tokens it took from the previous
step's sampled ids (async scheduling at work), and a loop that runs requests to completion."""

from __future__ import annotations

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.runner import ModelRunner
from sits.runtime.engine.sequence import PENDING_TOKEN_ID
from sits.runtime.models.loading import LoadedModel


class PendingCountingRunner(ModelRunner):
    """The engine's runner, counting input tokens taken from the previous step's sampled ids."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending_inputs = 0

    def launch(self, scheduler_output):
        self.pending_inputs += sum(s.token_ids.count(PENDING_TOKEN_ID) for s in scheduler_output.scheduled)
        return super().launch(scheduler_output)


def generate_all(loaded: LoadedModel, async_scheduling: bool, requests: dict) -> tuple[dict, LLMEngine]:
    """Run `requests` ({request_id: (prompt ids, SamplingParams)}) through one engine to the end.

    Returns ({request_id: [token ids of each completion]}, the engine, whose runner is a
    PendingCountingRunner).
    """
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=128),
                          cache=CacheConfig(block_size=8, num_blocks=96),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                          async_scheduling=async_scheduling)
    engine = LLMEngine.from_loaded(loaded, config, runner_factory=PendingCountingRunner)
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: [c.token_ids for c in o.outputs] for o in engine.step() if o.finished})
    assert set(finals) == set(requests)
    return finals, engine
