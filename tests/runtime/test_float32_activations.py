"""--activation-dtype float32: a bf16 model whose activations stay float32 follows the float32 model's answers.

SmolLM2-135M-Instruct (the embedded GGUF) on the CPU, torch back end, the 8 chat prompts of the GPU parity test
(tests/gpu/test_real_model_parity.py) against the float32 model's 48 greedy tokens each (EOS masked). A plain bf16
model rounds every projection's input to bf16 and keeps 4 of the 8 answers whole; with float32 activations only
the weights and the KV cache are bf16, and 7 of 8 stay whole (benchmarks/RESULTS.md, "Which bf16 operands cost
agreement with float32": the KV cache alone moves one near-tie).
"""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from sits.kernels.split_halves import split_halves, split_halves_reference
from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.commands.engine_args import add_engine_arguments, engine_config_from_args
from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.hardware import CPU_DEFAULTS
from sits.runtime.lora.config import LoraConfig
from sits.runtime.models.loading import load_model
from sits.runtime.models.mixed_linear import mixed_linear
from sits.runtime.parallel.config import ParallelConfig
from tests.gpu.test_real_model_parity import EOS_IDS, QUESTIONS, generate
from tests.runtime.test_bf16_residual_stream import (
    FLOAT32_ANSWERS,
    _answer_logprobs,
    teacher_forced_reference,
)

MIN_IDENTICAL = 7  # issue 13's bar for a half-precision engine against the float32 one, of 8 answers


@pytest.fixture(scope="module")
def bf16_float32_activations():
    loaded = load_model(ModelConfig(model=None, device="cpu", dtype="bfloat16"), TorchAttentionBackend(),
                        progress=False)
    loaded.model.use_activation_dtype(torch.float32)
    return loaded.model


@pytest.fixture(scope="module")
def reference(smollm2):
    return teacher_forced_reference(smollm2)


def test_two_bf16_halves_carry_sixteen_bits_of_the_input():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 3.0
    both = split_halves_reference(x, torch.bfloat16)
    hi, lo = both[:64].float(), both[64:].float()
    assert both.dtype == torch.bfloat16 and both.shape == (128, 512)
    assert (x - hi).abs().max() > 0  # bf16 alone loses bits
    assert ((hi + lo) - x).abs().le(x.abs() * 2.0**-16).all()


def test_the_split_kernel_matches_its_reference():
    """One launch writes hi then lo (float16 here: Triton's CPU interpreter mis-rounds bfloat16; the GPU test
    tests/gpu/test_mixed_linear.py covers bf16 through mixed_linear)."""
    x = torch.randn(40, 1500, generator=torch.Generator().manual_seed(2))[:, :1100]  # a row stride past K
    torch.testing.assert_close(split_halves(x, torch.float16), split_halves_reference(x, torch.float16),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="float32"):
        split_halves(x.half(), torch.float16)


def test_mixed_linear_on_the_cpu_is_the_float32_product():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 64, generator=generator)
    weight = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
    bias = torch.randn(48, generator=generator).to(torch.bfloat16)
    out = mixed_linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 48)
    torch.testing.assert_close(out, F.linear(x, weight.float(), bias.float()), rtol=0, atol=0)


def test_the_activations_are_float32_and_the_kv_cache_bf16(bf16_float32_activations):
    """Every projection reads and writes float32; the weights stay bf16 (and so does the cache the driver
    allocates in the weights' dtype)."""
    model = bf16_float32_activations
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    layer = model.model.layers[3]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    hooks = [p.register_forward_hook(lambda _, args, out: seen.append((args[0].dtype, out.dtype)))
             for p in projections]
    try:
        logprobs = _answer_logprobs(model, [[1, 2, 3, 4, 5]], [[6]])
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == [(torch.float32, torch.float32)] * 4
    assert {p.weight.dtype for p in projections} == {torch.bfloat16}
    assert logprobs.dtype == torch.float32 and torch.isfinite(logprobs).all()


def _mean_kl(model, reference) -> tuple[float, int]:
    """Teacher-forced over float32's answers: mean KL from float32, and argmax agreements (EOS masked)."""
    prompts, answers, exact = reference
    logprobs = _answer_logprobs(model, prompts, answers)
    masked = logprobs.clone()
    masked[:, EOS_IDS] = float("-inf")
    agree = int((masked.argmax(-1) == torch.tensor([t for a in answers for t in a])).sum())
    return float((exact.exp() * (exact - logprobs)).sum(-1).mean()), agree


def test_float32_activations_cut_the_drift_from_float32(bf16_float32_activations, reference):
    """Mean KL from float32 over the 384 answer tokens: 4.0e-4 for the bf16 model (its float32 residual stream
    included), ~1e-4 with float32 activations (the bf16 weights and KV cache are what is left)."""
    model = bf16_float32_activations
    kl, agree = _mean_kl(model, reference)
    model.use_activation_dtype(None)
    try:
        kl_bf16, agree_bf16 = _mean_kl(model, reference)
    finally:
        model.use_activation_dtype(torch.float32)
    total = len(reference[2])
    print(f"\nRESULT float32 activations: mean KL {kl:.2e}, {agree}/{total} argmax agree; bf16 activations "
          f"{kl_bf16:.2e}, {agree_bf16}/{total}")
    assert kl < 0.4 * kl_bf16
    assert agree >= total - 1 and agree >= agree_bf16


def _engine(activation_dtype: str) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model=ModelConfig(model=None, device="cpu", dtype="bfloat16", activation_dtype=activation_dtype,
                          max_model_len=512),
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024),
        attention_backend="torch", enforce_eager=True), progress=False)


def test_the_engine_answers_as_the_float32_engine():
    """The engine with --dtype bfloat16 --activation-dtype float32, 8 prompts batched: at least 7 of the 8
    greedy answers equal the float32 model's over 48 tokens (the bf16 model: 4)."""
    llm = _engine("float32")
    try:
        prompt_ids = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                           add_special_tokens=False) for q in QUESTIONS]
        outputs = generate(llm, prompt_ids, one_at_a_time=False)
        answers = [llm.tokenizer.encode(text, add_special_tokens=False) for text in FLOAT32_ANSWERS]
    finally:
        llm.shutdown()
    identical = sum(tokens == answer for (tokens, _), answer in zip(outputs, answers, strict=True))
    print(f"\nRESULT --activation-dtype float32 (bf16 weights and KV cache, CPU): {identical}/8 identical to float32")
    assert identical >= MIN_IDENTICAL


def _parse(*flags: str):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_flag_reaches_the_model_config():
    config = engine_config_from_args(_parse("--dtype", "bfloat16", "--activation-dtype", "float32"), CPU_DEFAULTS)
    assert config.model.activation_dtype == "float32"
    assert engine_config_from_args(_parse(), CPU_DEFAULTS).model.activation_dtype == "auto"
    with pytest.raises(SystemExit):
        _parse("--activation-dtype", "float16")


@pytest.mark.parametrize(("config", "message"), [
    (EngineConfig(model=ModelConfig(activation_dtype="float64")), "--activation-dtype must be one of auto, float32"),
    (EngineConfig(model=ModelConfig(activation_dtype="float32", quantization="fp8")), "needs unquantized weights"),
    (EngineConfig(model=ModelConfig(activation_dtype="float32"), compile=True), "does not run with --compile"),
    (EngineConfig(model=ModelConfig(activation_dtype="float32"), lora=LoraConfig(enable_lora=True)),
     "does not run with --enable-lora"),
    (EngineConfig(model=ModelConfig(activation_dtype="float32"), parallel=ParallelConfig(tensor_parallel_size=2)),
     "does not run with --tensor-parallel-size > 1"),
])
def test_what_float32_activations_do_not_run_with_is_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        config.validate()
