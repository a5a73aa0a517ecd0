"""The GPU engine on a CUDA device: Triton back end vs torch, CUDA graphs on vs off, fp8 / int8 accuracy.

The model has Llama-3-8B's head geometry (head_dim 128, four query heads per KV head) at a tiny
size, so these tests compile the same kernel variants the 8B benchmark runs. Weights are seeded
random bf16, with the output head scaled up so that greedy picks are not near-ties (a wrong kernel
must not hide behind a coin flip). Skipped without CUDA (tests/conftest.py); on the GPU machine
benchmarks/gpu_engine_run.sh runs them and keeps their printed figures.
"""

from __future__ import annotations

import pytest
import torch

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.quantize import quantize_model
from sits.runtime.models.random_model import random_loaded_model

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=128, rope_theta=500000.0, max_position_embeddings=4096, eos_token_ids=[2])
NEW_TOKENS = 512
PROMPT_LENS = (5, 37, 130, 300)


def model(backend_name: str, seed: int = 11):
    from sits.runtime.attention.registry import select_backend

    backend = select_backend(backend_name, "cuda", torch.bfloat16, 128)
    loaded = random_loaded_model(LlamaConfig(**SHAPE), backend, "cuda", torch.bfloat16, seed=seed)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(8.0)
    return loaded


def engine(loaded, *, enforce_eager: bool, max_num_seqs: int = 8) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(device="cuda", dtype="bfloat16", max_model_len=1024),
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
        enforce_eager=enforce_eager,
    )
    return LLMEngine.from_loaded(loaded, config)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, SHAPE["vocab_size"], (n,), generator=generator).tolist() for n in PROMPT_LENS]


def generate(engine: LLMEngine, new_tokens: int = NEW_TOKENS):
    """Greedy tokens and chosen-token logprobs of every prompt, all batched (decode steps of 4)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=0)
    for index, prompt in enumerate(prompts()):
        engine.add_request(str(index), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[int(output.request_id)] = output.outputs[0]
    return ([done[i].token_ids for i in range(len(PROMPT_LENS))],
            [[lp.logprob for lp in done[i].logprobs] for i in range(len(PROMPT_LENS))])


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    return same / sum(map(len, a))


def logprob_error(a, b, tokens_a, tokens_b) -> float:
    """Largest |Δ logprob| of the chosen token over the positions before each sequence's first divergence."""
    worst = 0.0
    for la, lb, ta, tb in zip(a, b, tokens_a, tokens_b, strict=True):
        for x, y, s, t in zip(la, lb, ta, tb, strict=True):
            if s != t:
                break
            worst = max(worst, abs(x - y))
    return worst


def test_triton_back_end_agrees_with_torch_over_512_tokens(record_property):
    torch_tokens, torch_logprobs = generate(engine(model("torch"), enforce_eager=True))
    triton_engine = engine(model("triton"), enforce_eager=False)
    assert triton_engine.runner.decode_graphs is not None
    triton_tokens, triton_logprobs = generate(triton_engine)
    share = agreement(torch_tokens, triton_tokens)
    error = logprob_error(torch_logprobs, triton_logprobs, torch_tokens, triton_tokens)
    print(f"\nRESULT triton vs torch (bf16, 4 x {NEW_TOKENS} greedy tokens): agreement {share:.2%}, "
          f"max |d logprob| {error:.4f}")
    record_property("agreement", share)
    assert share >= 0.99
    assert error < 0.1


def test_cuda_graphs_on_and_off_give_the_same_tokens():
    loaded = model("triton")
    eager_tokens, _ = generate(engine(loaded, enforce_eager=True), 128)
    graph_engine = engine(loaded, enforce_eager=False)
    assert graph_engine.runner.decode_graphs is not None and graph_engine.runner.decode_graphs.graphs
    graph_tokens, _ = generate(graph_engine, 128)
    print(f"\nRESULT graphs on vs off: agreement {agreement(eager_tokens, graph_tokens):.2%}")
    assert graph_tokens == eager_tokens


@torch.inference_mode()
def teacher_forced_logits(loaded, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of one prefill of `tokens` through the engine's runner."""
    eng = engine(loaded, enforce_eager=True)
    from sits.runtime.engine.model_input import build_model_input
    from sits.runtime.engine.scheduler_output import ScheduledSequence
    from sits.runtime.engine.sequence import Sequence

    seq = Sequence("q", "q", 0, tokens, SamplingParams(temperature=0.0), len(tokens) + 1, 0.0)
    blocks = list(range(-(-len(tokens) // 16)))
    model_input = build_model_input([ScheduledSequence(seq, tokens, 0, blocks, samples=True)], 16, "cuda")
    hidden = eng.runner._forward(model_input)
    return loaded.model.compute_logits(hidden)


@pytest.mark.parametrize("method,max_rel_error,min_agreement", [("fp8", 0.15, 0.7), ("int8", 0.03, 0.9)])
def test_quantized_weights_stay_close_to_bf16(method, max_rel_error, min_agreement):
    tokens = prompts()[3]
    reference = teacher_forced_logits(model("triton"), tokens)
    quantized = model("triton")
    assert quantize_model(quantized.model, method) == 2 * 4
    logits = teacher_forced_logits(quantized, tokens)
    rel_error = float((logits - reference).norm() / reference.norm())
    greedy = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    print(f"\nRESULT {method} vs bf16 (random Llama, head_dim 128, {len(tokens)} positions): greedy agreement "
          f"{greedy:.2%}, relative logit error {rel_error:.4f}")
    assert rel_error < max_rel_error
    assert greedy >= min_agreement
    quantized_tokens, _ = generate(engine(quantized, enforce_eager=False), 32)
    assert all(len(t) == 32 for t in quantized_tokens)
