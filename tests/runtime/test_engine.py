"""LLMEngine end to end through the real models: SmolLM2-135M-Instruct and a tiny random GQA Llama.

Greedy tokens must equal transformers' `generate` for each prompt whether it runs alone or batched
with prompts of other lengths, with chunked prefill, and under a KV budget so small that sequences
are preempted and recomputed.
"""

from __future__ import annotations

import functools

import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from sits.runtime.engine.request import FinishReason, RequestOutput, SamplingParams, SamplingParamsError
from sits.runtime.models.loading import load_model

NEW_TOKENS = 8
PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he",
    "Q: What is 12 times 12?\nA:",
]


def engine_config(*, max_model_len=256, block_size=16, num_blocks=64, max_batched=2048, max_seqs=16,
                  prefix_caching=True) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched),
    )


def greedy(max_tokens=NEW_TOKENS, **overrides) -> SamplingParams:
    # min_tokens masks EOS as transformers' min_new_tokens does, so both run the full length.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **overrides)


def run_to_completion(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
                      max_steps: int = 500) -> dict[str, RequestOutput]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    assert not engine.has_unfinished_requests(), "requests did not finish"
    return final


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_smollm2_reference(smollm2_checkpoint_dir):
    """transformers' SmolLM2 on the converted checkpoint our loader reads (same weights as the GGUF)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_checkpoint_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    """Our loader on the tiny random HF checkpoint, and transformers on the same files."""
    from transformers import AutoModelForCausalLM

    ours = load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"),
                      TorchAttentionBackend(), progress=False)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return ours, reference


class ModelUnderTest:
    """A loaded model, PROMPTS as its token ids, and transformers' greedy continuations (computed once)."""

    def __init__(self, loaded, reference) -> None:
        self.loaded = loaded
        self.reference = reference
        self.prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]

    @functools.cache  # noqa: B019 - one instance per module, kept for the module's life
    def expected(self, index: int) -> list[int]:
        prompt = self.prompts[index]
        with torch.inference_mode():
            out = self.reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=2, pad_token_id=2,
            )
        return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def smollm2_under_test(smollm2, hf_smollm2_reference) -> ModelUnderTest:
    return ModelUnderTest(smollm2, hf_smollm2_reference)


@pytest.fixture(scope="module")
def tiny_under_test(tiny_llama) -> ModelUnderTest:
    return ModelUnderTest(*tiny_llama)


@pytest.fixture(params=["smollm2", "tiny_llama"])
def model_pair(request) -> ModelUnderTest:
    name = "smollm2_under_test" if request.param == "smollm2" else "tiny_under_test"
    return request.getfixturevalue(name)


def test_greedy_matches_transformers_alone_and_batched(model_pair):
    loaded, prompts, expected = model_pair.loaded, model_pair.prompts, model_pair.expected
    engine = LLMEngine.from_loaded(loaded, engine_config())
    for i, prompt in enumerate(prompts):
        alone = run_to_completion(engine, {f"alone-{i}": (prompt, greedy())})
        assert alone[f"alone-{i}"].outputs[0].token_ids == expected(i), f"prompt {i} alone"
    batched = run_to_completion(engine, {f"b{i}": (p, greedy()) for i, p in enumerate(prompts)})
    for i in range(len(prompts)):
        output = batched[f"b{i}"].outputs[0]
        assert output.token_ids == expected(i), f"prompt {i} batched"
        assert output.finish_reason is FinishReason.LENGTH
        assert output.text == loaded.tokenizer.decode(expected(i))


def test_greedy_is_unchanged_by_chunked_prefill_and_preemption(model_pair):
    loaded, prompts, expected = model_pair.loaded, model_pair.prompts, model_pair.expected
    # 12-token steps chunk the longer prompts; 8 blocks of 8 tokens cannot hold all four sequences.
    config = engine_config(max_model_len=64, block_size=8, num_blocks=8, max_batched=12)
    engine = LLMEngine.from_loaded(loaded, config)
    outputs = run_to_completion(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(prompts)})
    for i in range(len(prompts)):
        assert outputs[f"r{i}"].outputs[0].token_ids == expected(i), f"prompt {i}"
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert stats.num_finished == len(prompts)


def test_repeated_prompt_hits_the_prefix_cache(smollm2):
    engine = LLMEngine.from_loaded(smollm2, engine_config(block_size=8))
    prompt = smollm2.tokenizer.encode(PROMPTS[2])  # 35 tokens: 4 full blocks of 8
    first = run_to_completion(engine, {"first": (prompt, greedy(4))})["first"]
    assert engine.stats().prefix_cache_hits == 0
    again = run_to_completion(engine, {"again": (prompt, greedy(4))})["again"]
    stats = engine.stats()
    assert stats.prefix_cache_hits == 32 == again.metrics.num_cached_prompt_tokens
    assert stats.prefix_cache_queries == 2 * len(prompt)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_abort_frees_every_block(smollm2):
    engine = LLMEngine.from_loaded(smollm2, engine_config(block_size=8))
    prompts = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=50), tenant="acme")
    for _ in range(2):
        engine.step()
    assert engine.stats().kv_blocks_used > 0 and engine.stats().kv_blocks_used_by_tenant["acme"] > 0
    finals = engine.abort_request([f"r{i}" for i in range(len(prompts))] + ["never-seen"])
    assert {f.request_id for f in finals} == {f"r{i}" for i in range(len(prompts))}
    assert all(f.finished and f.outputs[0].finish_reason is FinishReason.ABORT for f in finals)
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_cache_usage == 0.0
    assert stats.num_aborted == len(prompts) and not engine.has_unfinished_requests()
    assert engine.step() == []


def test_streamed_deltas_add_up_to_the_final_output(smollm2):
    engine = LLMEngine.from_loaded(smollm2, engine_config())
    engine.add_request("s", smollm2.tokenizer.encode("List three fruits:"),
                       SamplingParams(temperature=0.0, max_tokens=12, logprobs=2))
    text, tokens, logprobs, last = "", [], [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            text += completion.text_delta
            tokens += completion.token_ids_delta
            logprobs += completion.logprobs_delta
            last = output
    final = last.outputs[0]
    assert last.finished and text == final.text and tokens == final.token_ids
    assert len(logprobs) == len(tokens) and logprobs == final.logprobs
    for token, logprob in zip(tokens, logprobs, strict=True):
        assert logprob.token_id == token and logprob.top[0] == (token, logprob.logprob)  # greedy: the best
        assert len(logprob.top) == 2 and logprob.logprob <= 0.0
    assert final.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in logprobs))
    metrics = last.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finished_time


def test_stop_string_and_stop_token_end_the_completion(smollm2_under_test):
    loaded, prompts, expected = smollm2_under_test.loaded, smollm2_under_test.prompts, smollm2_under_test.expected
    tokenizer = loaded.tokenizer
    engine = LLMEngine.from_loaded(loaded, engine_config())
    reference_text = tokenizer.decode(expected(0))
    stop = reference_text[len(reference_text) // 2:][:3]
    assert stop.strip(), reference_text
    stop_token = expected(0)[4]
    outputs = run_to_completion(engine, {
        "by_string": (prompts[0], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[stop])),
        "by_token": (prompts[0], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[stop_token])),
    })
    by_string = outputs["by_string"].outputs[0]
    assert by_string.finish_reason is FinishReason.STOP and by_string.stop_reason == stop
    assert by_string.text == reference_text[: reference_text.index(stop)]
    assert by_string.token_ids == expected(0)[: len(by_string.token_ids)]
    by_token = outputs["by_token"].outputs[0]
    first_stop = expected(0).index(stop_token)
    assert by_token.token_ids == expected(0)[: first_stop + 1] and by_token.stop_reason == stop_token
    assert by_token.text == tokenizer.decode(expected(0)[:first_stop])
    assert engine.stats().kv_blocks_used == 0


def test_n_completions_share_the_prompt_and_seeds_reproduce(tiny_llama):
    loaded, _ = tiny_llama
    prompt = loaded.tokenizer.encode(PROMPTS[2])  # 35 tokens: 4 full blocks of 8
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1234)
    engine = LLMEngine.from_loaded(loaded, engine_config(block_size=8))
    output = run_to_completion(engine, {"r": (prompt, params)})["r"]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 8 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3  # seed + index: different draws
    assert engine.stats().prefix_cache_hits == 2 * 32  # completions 1 and 2 reuse completion 0's prompt

    # The same seed gives the same tokens, alone or batched with other requests.
    other = LLMEngine.from_loaded(loaded, engine_config(block_size=8))
    batch = {"r": (prompt, params)}
    for i in range(3):
        batch[f"noise{i}"] = (loaded.tokenizer.encode(PROMPTS[i]), SamplingParams(temperature=1.0, max_tokens=5 + i))
    again = run_to_completion(other, batch)["r"]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]


def test_bad_requests_are_rejected_with_clear_errors(tiny_llama):
    loaded, _ = tiny_llama
    engine = LLMEngine.from_loaded(loaded, engine_config(max_model_len=64))
    with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
        engine.add_request("long", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(PromptTooLongError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("vocab", [5, 10**9], SamplingParams())
    with pytest.raises(SamplingParamsError):
        engine.add_request("temp", [5], SamplingParams(temperature=-1.0))
    engine.add_request("ok", [5, 6], SamplingParams(max_tokens=None))
    with pytest.raises(DuplicateRequestError):
        engine.add_request("ok", [5, 6], SamplingParams())
    output = run_to_completion(engine, {})["ok"].outputs[0]  # max_tokens None: up to max_model_len
    assert len(output.token_ids) == 62 and output.finish_reason is FinishReason.LENGTH
    assert isinstance(PromptTooLongError("x"), ValueError)
    with pytest.raises(ConfigError, match="exceeds the 512 positions"):
        LLMEngine.from_loaded(loaded, engine_config(max_model_len=4096, num_blocks=300))
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        LLMEngine.from_loaded(loaded, engine_config(max_model_len=256, num_blocks=8))


def test_cache_salt_keeps_prefix_hits_within_a_tenant(tiny_llama):
    loaded, _ = tiny_llama
    engine = LLMEngine.from_loaded(loaded, engine_config(block_size=8))
    prompt = loaded.tokenizer.encode(PROMPTS[2])  # 4 full blocks before the last token

    def run(request_id: str, salt: str | None) -> RequestOutput:
        engine.add_request(request_id, prompt, greedy(2), tenant=salt or "default", cache_salt=salt)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    return output
        raise AssertionError("no output")

    first = run("acme-1", "acme")
    assert run("globex-1", "globex").metrics.num_cached_prompt_tokens == 0
    assert run("unsalted", None).metrics.num_cached_prompt_tokens == 0
    again = run("acme-2", "acme")
    assert again.metrics.num_cached_prompt_tokens == 32 and again.tenant == "acme"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_tenancy_hooks_are_built_once_the_cache_is_sized(tiny_llama):
    from sits.runtime.engine.eviction import LRUEvictionPolicy
    from sits.runtime.engine.scheduling_policy import OrderedWaitingQueue, PriorityPolicy

    loaded, _ = tiny_llama
    sized: list[int] = []
    policy = LRUEvictionPolicy()
    queue = OrderedWaitingQueue(PriorityPolicy())

    def eviction_policy(num_blocks: int) -> LRUEvictionPolicy:
        sized.append(num_blocks)
        return policy

    engine = LLMEngine.from_loaded(loaded, engine_config(num_blocks=40), eviction_policy=eviction_policy,
                                   waiting_queue=queue)
    assert sized == [40]
    assert engine.kv_cache.pool.eviction_policy is policy and engine.scheduler.waiting is queue
    engine.add_request("low", [5, 6, 7], greedy(1), priority=0)
    engine.add_request("high", [8, 9], greedy(1), priority=3)
    assert [s.request_id for s in queue] == ["high", "low"]
    assert set(run_to_completion(engine, {})) == {"low", "high"}
