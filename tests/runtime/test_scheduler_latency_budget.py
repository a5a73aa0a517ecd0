"""The decodes' latency budget (`--max-prefill-tokens-with-decodes`): in a step that runs decodes,
prompt tokens are capped, so long prompts are chunked beside them; prompts still finish, and greedy
outputs are those of the engine without the cap."""

from __future__ import annotations

import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.scheduler import Scheduler
from sits.runtime.models.presets import preset_config
from sits.runtime.models.random_model import random_loaded_model
from tests.runtime.test_scheduler import EOS, make_seq, run_step

CAP = 8


def capped_scheduler(cap: int = CAP, max_tokens: int = 64, chunked: bool = True, min_decodes: int = 0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_tokens, enable_chunked_prefill=chunked,
                             max_prefill_tokens_with_decodes=cap, prefill_cap_min_decodes=min_decodes)
    return Scheduler(config, KVCacheManager(256, 4), 512, eos_token_ids=[EOS])


def split(output) -> tuple[int, int]:
    """(decodes scheduled, prompt tokens scheduled) of one step."""
    decodes = [s for s in output.scheduled if s.num_new_tokens == 1 and s.start_position >= s.sequence.num_prompt_tokens]
    return len(decodes), output.num_batched_tokens - len(decodes)


def test_a_long_prompt_is_chunked_to_the_budget_while_decodes_run_and_still_finishes():
    scheduler = capped_scheduler()
    for i in range(3):
        scheduler.add_request(make_seq(f"d{i}", 4, max_tokens=40))
    first = run_step(scheduler)  # no decodes yet: the three prompts go at once (12 tokens > the cap)
    assert split(first) == (0, 12)
    long_prompt = make_seq("long", 50, max_tokens=2)
    scheduler.add_request(long_prompt)
    prompt_steps = 0
    while long_prompt.num_output_tokens == 0:
        output = run_step(scheduler)
        decodes, prompt_tokens = split(output)
        assert decodes == 3  # every running decode advances every step
        assert prompt_tokens <= CAP
        prompt_steps += 1
    assert prompt_steps == -(-50 // CAP)  # 7 steps of at most 8 tokens: no starvation, no wasted step


def test_the_budget_binds_only_beside_enough_decodes():
    """With prefill_cap_min_decodes=4, a prompt beside 3 decodes fills the step; beside 4 it is chunked."""
    scheduler = capped_scheduler(min_decodes=4)
    for i in range(3):
        scheduler.add_request(make_seq(f"d{i}", 4, max_tokens=40))
    run_step(scheduler)
    scheduler.add_request(make_seq("burst", 40, max_tokens=40))
    assert split(run_step(scheduler)) == (3, 40)  # few decodes: the whole prompt at once
    scheduler.add_request(make_seq("long", 40, max_tokens=2))
    assert split(run_step(scheduler)) == (4, CAP)  # four decodes now: the budget holds


def test_the_budget_is_shared_by_running_prefills_and_new_prompts_oldest_first():
    scheduler = capped_scheduler()
    scheduler.add_request(make_seq("d0", 4, max_tokens=40))
    run_step(scheduler)
    first, second = make_seq("p1", 20, max_tokens=1), make_seq("p2", 20, max_tokens=1)
    scheduler.add_request(first)
    scheduler.add_request(second)
    seen = []
    while not (first.finished and second.finished):
        output = run_step(scheduler)
        assert split(output)[1] <= CAP
        seen.append({s.seq_id: s.num_new_tokens for s in output.scheduled if s.seq_id != "d0"})
    assert seen[0] == {"p1": 8} and seen[1] == {"p1": 8} and seen[2] == {"p1": 4, "p2": 4}


def test_a_step_without_decodes_takes_the_whole_token_budget():
    scheduler = capped_scheduler(max_tokens=64)
    scheduler.add_request(make_seq("alone", 60, max_tokens=2))
    assert split(run_step(scheduler)) == (0, 60)


def test_without_chunked_prefill_the_cap_does_not_apply():
    scheduler = capped_scheduler(chunked=False)
    scheduler.add_request(make_seq("d0", 4, max_tokens=40))
    run_step(scheduler)
    scheduler.add_request(make_seq("p", 30, max_tokens=1))
    assert split(run_step(scheduler)) == (1, 30)  # a whole prompt or nothing, as without a budget


def test_a_negative_budget_is_a_config_error_naming_the_flag():
    with pytest.raises(ConfigError, match="--max-prefill-tokens-with-decodes"):
        SchedulerConfig(max_prefill_tokens_with_decodes=-1).validate()


def test_greedy_outputs_are_those_of_the_engine_without_the_budget():
    torch.manual_seed(0)
    loaded = random_loaded_model(preset_config("tiny"), TorchAttentionBackend(), "cpu", torch.float32, seed=3)
    generator = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(3, 500, (n,), generator=generator).tolist()
               for i, n in enumerate((5, 70, 9, 120, 33))}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def generate(cap: int) -> tuple[dict[str, list[int]], int]:
        config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=256),
                              cache=CacheConfig(block_size=8, num_blocks=128),
                              scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128,
                                                        max_prefill_tokens_with_decodes=cap))
        engine = LLMEngine.from_loaded(loaded, config)
        for index, (request_id, prompt) in enumerate(prompts.items()):
            engine.add_request(request_id, prompt, params)
            if index == 1:  # the later prompts arrive while the first ones decode
                engine.step()
        outputs, steps = {}, 1
        while engine.has_unfinished_requests():
            steps += 1
            outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return outputs, steps

    uncapped, uncapped_steps = generate(0)
    capped, capped_steps = generate(16)
    assert capped == uncapped and set(capped) == set(prompts)
    assert capped_steps > uncapped_steps  # the cap did split prompts across more steps
