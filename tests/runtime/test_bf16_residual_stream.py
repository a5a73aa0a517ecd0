"""bf16 on real weights stays close to float32: the residual stream between sublayers is kept in float32.

SmolLM2-135M-Instruct (the embedded GGUF) on the CPU, torch back end, the 8 chat prompts of the GPU parity
test (tests/gpu/test_real_model_parity.py) with the float32 model's 48 greedy answer tokens (EOS masked),
teacher-forced. A bf16 stream rounds every layer's two sums to 8 bits of mantissa: half of bf16's drift from
float32 on these answers (mean KL 8.0e-4 → 4.0e-4; benchmarks/RESULTS.md, "Which bf16 activation
roundings").
"""

from __future__ import annotations

import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ModelConfig
from sits.runtime.models.loading import load_model
from tests.gpu.test_real_model_parity import EOS_IDS, QUESTIONS
from tests.support.model_driver import PagedKVCache, PagedSequence, build_metadata

# The float32 model's greedy answers to QUESTIONS, 48 tokens each (EOS masked), as text: each encodes back to
# exactly those tokens, and the drift test checks that they are still float32's argmax at every position.
FLOAT32_ANSWERS = [
    "The capital of France is Paris. It's a city steeped in history and culture, known for its iconic landmarks "
    "like the Eiffel Tower, Louvre Museum, Notre-Dame Cathedral, and many others. Paris is also a major global",
    "The primary colors are: Red, Blue, and Yellow. These three colors are fundamental in the color wheel, "
    "representing the additive and subtractive color mixing processes. They are also known as the \"primary "
    "colors\" because they are the only colors",
    "The waves of the sea, a silent beauty,\nA gentle lapping of the shore,\nA reminder of the beauty that lies "
    "beneath,\nA reminder of the ocean's power.\n\nIn this haiku, I've tried",
    "Photosynthesis is a vital biological process that converts carbon dioxide into organic molecules, such as "
    "glucose and oxygen, using sunlight as a source of energy. This process is essential for life on Earth, as "
    "it provides the primary energy source for nearly all",
    "12 times 7 is a classic problem that involves multiplication and division. In mathematics, when you have a "
    "multiplication of 12 by itself (12), you can think of it as multiplying 12 by itself, which is",
    "The art of cooking is a skill that can be learned and mastered with dedication and practice. One tip that "
    "can help you improve your cooking skills is to start by learning a few basic recipes. This can be as simple "
    "as learning a few ingredients",
    "The answer to this question lies in the intricate dance of light and color. The sky appears blue because "
    "of a phenomenon known as Rayleigh scattering. This occurs when light encounters molecules of air, which "
    "scatter the shorter wavelengths of light, particularly the",
    "Hoy, buen hora!\n\nIn Spanish, the phrase \"good morning\" is a common idiomatic expression that translates "
    "to \"morning\" in English. The key to this translation lies in the use of the Spanish verb",
]


@pytest.fixture(scope="module")
def bf16():
    return load_model(ModelConfig(model=None, device="cpu", dtype="bfloat16"), TorchAttentionBackend(), progress=False)


@pytest.fixture(scope="module")
def reference(smollm2):
    return teacher_forced_reference(smollm2)


def teacher_forced_reference(smollm2):
    """The 8 chat prompts, the float32 answers' tokens and float32's log-softmax rows predicting them."""
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                add_special_tokens=False) for q in QUESTIONS]
    answers = [tokenizer.encode(text, add_special_tokens=False) for text in FLOAT32_ANSWERS]
    return prompts, answers, _answer_logprobs(smollm2.model, prompts, answers)


@torch.inference_mode()
def _answer_logprobs(model, prompts: list[list[int]], answers: list[list[int]]) -> torch.Tensor:
    """log-softmax rows predicting every answer token, prompt + answer in one prefill each: [8 * 48, vocab]."""
    rows = []
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = prompt + answer
        cache = PagedKVCache(model, num_blocks=-(-len(ids) // 16) + 1, block_size=16)
        positions, metadata, _ = build_metadata(cache, [(PagedSequence(ids), len(ids))], torch.device("cpu"))
        hidden = model(torch.tensor(ids), positions, cache.caches, metadata)
        rows.append(torch.log_softmax(model.compute_logits(hidden[len(prompt) - 1:-1]), dim=-1))
    return torch.cat(rows)


def test_the_stream_is_float32_and_the_sublayers_run_in_bf16(bf16):
    """Each layer hands the next its MLP output (bf16) and the carried stream (float32)."""
    model = bf16.model
    streams, mlp_inputs = [], []
    hooks = [layer.register_forward_hook(lambda _, args, out: streams.append((out[0].dtype, out[1].dtype)))
             for layer in model.model.layers]
    hooks += [layer.mlp.register_forward_pre_hook(lambda _, args: mlp_inputs.append(args[0].dtype))
              for layer in model.model.layers]
    try:
        logprobs = _answer_logprobs(model, [[1, 2, 3]], [[4]])
    finally:
        for hook in hooks:
            hook.remove()
    assert model.residual_dtype == torch.float32
    assert streams == [(torch.bfloat16, torch.float32)] * len(model.model.layers)
    assert mlp_inputs == [torch.bfloat16] * len(model.model.layers)  # the norms write the model dtype
    assert logprobs.dtype == torch.float32 and logprobs.shape == (1, model.config.vocab_size)


def _mean_kl(model, reference) -> float:
    prompts, answers, exact = reference
    return float((exact.exp() * (exact - _answer_logprobs(model, prompts, answers))).sum(-1).mean())


def test_bf16_drift_is_halved_by_a_float32_stream(bf16, reference):
    """Teacher-forced over float32's answers: mean KL from float32 (8.0e-4 with a bf16 stream, 4.0e-4 now)."""
    _, answers, exact = reference
    masked = exact.clone()
    masked[:, EOS_IDS] = float("-inf")
    assert masked.argmax(-1).tolist() == [t for a in answers for t in a]  # they are float32's greedy answers
    kl = _mean_kl(bf16.model, reference)
    bf16.model.residual_dtype = None  # the model dtype: the stream rounded to bf16 at every add
    try:
        kl_bf16_stream = _mean_kl(bf16.model, reference)
    finally:
        bf16.model.residual_dtype = torch.float32
    print(f"\nRESULT bf16 mean KL from float32 over {len(exact)} answer tokens: float32 stream {kl:.2e}, "
          f"bf16 stream {kl_bf16_stream:.2e}")
    assert kl < 6e-4
    assert kl < 0.7 * kl_bf16_stream
