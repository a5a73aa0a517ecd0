"""Weight quantization (--quantization fp8 / int8): the converted layers, and their accuracy against full precision.

On a CPU the quantized layers run the plain-PyTorch references of the GPU kernels (the same
function: per-channel e4m3 weights with per-token e4m3 activations; int8 weights with per-group
scales), so the accuracy figures here are the quantization's own, on a random Llama and on the
real SmolLM2-135M. The GPU kernels are checked against those references in tests/kernels and on
the GPU by test_gpu_engine.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.llama import LMHead
from sits.runtime.models.quantize import (
    Fp8Linear,
    Int8Linear,
    int8_group_size,
    quantization_of,
    quantize_model,
)
from sits.runtime.models.random_model import random_loaded_model
from tests.support.model_driver import PagedKVCache, PagedSequence, build_metadata

TINY = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                   eos_token_ids=[2])


def tiny(seed: int = 0):
    loaded = random_loaded_model(TINY, TorchAttentionBackend(), "cpu", torch.float32, seed=seed)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(8.0)  # logits with a spread, as a trained model has
    return loaded


@torch.inference_mode()
def all_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 logits of every position (one prefill through the paged cache)."""
    cache = PagedKVCache(model, -(-len(tokens) // 16) + 1, 16)
    seq = PagedSequence(list(tokens))
    positions, metadata, _ = build_metadata(cache, [(seq, len(tokens))], torch.device("cpu"))
    hidden = model(torch.tensor(tokens), positions, cache.caches, metadata)
    return model.compute_logits(hidden)


def compare(reference: torch.Tensor, quantized: torch.Tensor) -> tuple[float, float]:
    """(greedy agreement over positions, relative logit error ||q - r|| / ||r||)."""
    agreement = float((reference.argmax(-1) == quantized.argmax(-1)).float().mean())
    return agreement, float((quantized - reference).norm() / reference.norm())


def test_quantized_linears_compute_the_scaled_products():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    x = torch.randn(5, 64)
    fp8 = Fp8Linear.from_linear(linear)
    w = fp8.weight.float() * fp8.weight_scale[:, None]
    x_scale = x.abs().amax(-1, keepdim=True) / 448.0
    x_q = (x / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    torch.testing.assert_close(fp8(x), x_q @ w.t() + linear.bias, rtol=1e-5, atol=1e-5)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight.element_size() == 1
    int8 = Int8Linear.from_linear(linear, group_size=32)
    scales = int8.scales.repeat_interleave(32, dim=1)
    torch.testing.assert_close(int8(x), x @ (int8.weight.float() * scales).t() + linear.bias, rtol=1e-5, atol=1e-5)
    assert (linear.weight - int8.weight.float() * scales).abs().max() <= scales.max() / 2 + 1e-7
    assert int8_group_size(576) == 64 and int8_group_size(1536) == 128 and int8_group_size(40) is None


def test_every_linear_but_the_output_head_is_converted():
    loaded = tiny()
    assert quantize_model(loaded.model, "fp8") == 2 * 4
    assert quantization_of(loaded.model) == "fp8"
    assert type(loaded.model.lm_head) is LMHead  # the output head keeps the model dtype (float32 logits)
    assert isinstance(loaded.model.model.layers[1].mlp.down_proj, Fp8Linear)
    with pytest.raises(ValueError, match="quantization must be one of none, fp8, int8"):
        quantize_model(loaded.model, "int4")


@pytest.mark.parametrize("method,min_agreement,max_error", [("fp8", 0.8, 0.12), ("int8", 0.92, 0.05)])
def test_accuracy_against_full_precision_on_random_llama_and_smollm2(smollm2, method, min_agreement, max_error):
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
            "movable metal type, oil-based ink and a screw press. Within fifty years printers worked in more than "
            "two hundred cities, and the price of books fell sharply, which")
    tokens = smollm2.tokenizer.encode(text)
    figures = {}
    for name, model in (("random Llama", tiny().model), ("SmolLM2-135M", smollm2.model)):
        reference = all_logits(model, tokens if name == "SmolLM2-135M" else [t % TINY.vocab_size for t in tokens])
        quantized = copy.deepcopy(model)
        quantize_model(quantized, method)
        got = all_logits(quantized, tokens if name == "SmolLM2-135M" else [t % TINY.vocab_size for t in tokens])
        figures[name] = compare(reference, got)
        del quantized
    print("\n" + "; ".join(f"RESULT {method} vs float32, {name} ({len(tokens)} positions): greedy agreement "
                          f"{a:.1%}, relative logit error {e:.4f}" for name, (a, e) in figures.items()))
    for name, (agreement, error) in figures.items():
        assert error < max_error, name
        assert agreement >= min_agreement, name


def test_the_engine_quantizes_what_its_config_asks_for():
    loaded = tiny()
    config = EngineConfig(model=ModelConfig(device="cpu", max_model_len=64, quantization="int8"),
                          cache=CacheConfig(num_blocks=16), scheduler=SchedulerConfig(max_num_seqs=2))
    engine = LLMEngine.from_loaded(loaded, config)
    assert quantization_of(loaded.model) == "int8"
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert len(outputs[0].outputs[0].token_ids) == 4
    LLMEngine.from_loaded(loaded, config)  # already int8: nothing to do
    config.model.quantization = "fp8"
    with pytest.raises(ConfigError, match="already quantized to int8"):
        LLMEngine.from_loaded(loaded, config)
