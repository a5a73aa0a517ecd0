"""`LLMEngine` with tensor_parallel_size=2 on CPU: the engine spawns its worker and generates what TP=1 does.

It needs the engine's tensor-parallel hooks (EngineConfig.parallel, a runner factory in LLMEngine,
LLMEngine.shutdown); until they are in, it is skipped with that reason.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch.distributed as dist

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.parallel.config import ParallelConfig

ENGINE_HOOKS = "parallel" in EngineConfig.__dataclass_fields__ and hasattr(LLMEngine, "shutdown")
pytestmark = pytest.mark.skipif(not ENGINE_HOOKS, reason="the engine's tensor-parallel hooks are not in yet")

NEW_TOKENS = 16
PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64, 12, 4001, 77], [5, 200, 11]]


def generate(checkpoint_dir, tensor_parallel_size: int) -> list[list[int]]:
    config = EngineConfig(
        model=ModelConfig(model=str(checkpoint_dir), device="cpu", dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=4, num_blocks=64),
        # 8 tokens per step: the longer prompt is prefilled in chunks, next to the other's decodes.
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),
        attention_backend="torch",
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
    )
    engine = LLMEngine.from_config(config, progress=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{index}", prompt, params)
        finished = {}
        for _ in range(200):
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
    finally:
        engine.shutdown()
    return [finished[f"r{index}"] for index in range(len(PROMPTS))]


@pytest.mark.timeout(180)
def test_tensor_parallel_engine_generates_what_one_process_generates(tiny_llama_dir):
    expected = generate(tiny_llama_dir, 1)
    got = generate(tiny_llama_dir, 2)
    assert got == expected
    assert all(len(tokens) == NEW_TOKENS for tokens in got)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()
