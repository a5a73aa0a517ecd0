"""fp8 w8a8: the decoder norms before qkv_proj and gate_up_proj quantize their rows in their own launch.

LlamaDecoderLayer calls `RMSNorm.quantized` and the projection's forward_quantized (an Fp8SwiGLU's
forward_quantized_input) where the norm is the Triton one and the consumer a w8a8 Fp8Linear / Fp8SwiGLU that
fuse_fp8_norm_quant enabled; everything else keeps its path. On the CPU the Triton norm runs through the
interpreter and the quantization is the reference (as Fp8Linear's off CUDA), so the fused model's logits are
the unfused model's bit for bit; on a GPU the kernel test (tests/kernels/test_rmsnorm_quant.py) shows the
fused kernel equals the norm then the quantization kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.models.kernel_ops import TORCH_OPS, TritonKernelOps
from sits.runtime.models.quantize import (
    NORM_QUANT_ENV,
    Fp8Linear,
    Fp8SwiGLU,
    fuse_fp8_norm_quant,
    quantize_model,
)
from sits.runtime.models.random_model import random_loaded_model
from sits.runtime.parallel.tp import TensorParallelLayout
from tests.runtime.test_quantize import TINY, all_logits

TOKENS = [(7 * i + 3) % TINY.vocab_size for i in range(24)]
LAYERS = TINY.num_hidden_layers


def _with_ops(model, ops):
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
    return model


def _models(dtype, device="cpu"):
    """(fused, unfused) fp8 w8a8 copies of one tiny model with the Triton norms; unfused: no norm quantization
    (its MLPs still Fp8SwiGLU)."""
    loaded = random_loaded_model(TINY, TorchAttentionBackend(), device, dtype, seed=0)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(8.0)
    quantize_model(loaded.model, "fp8", fp8_mode="w8a8")
    unfused = copy.deepcopy(loaded.model)
    for module in unfused.modules():
        if isinstance(module, Fp8Linear):
            module.input_quantized_upstream = False
    ops = TritonKernelOps()
    return _with_ops(loaded.model, ops), _with_ops(unfused, ops)


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused norm calls and the quantized-input projections: {"norm": n, "qkv": n, "mlp": n}."""
    counts = {"norm": 0, "qkv": 0, "mlp": 0}
    real_norm, real_linear = TritonKernelOps.rms_norm_quant_fp8, Fp8Linear.forward_quantized
    real_mlp = Fp8SwiGLU.forward_quantized_input

    def norm(self, *args):
        counts["norm"] += 1
        return real_norm(self, *args)

    def linear(self, x_fp8, x_scale, out_dtype):
        counts["qkv"] += self.out_features == (TINY.num_attention_heads + 2 * TINY.num_key_value_heads) * TINY.head_dim
        return real_linear(self, x_fp8, x_scale, out_dtype)

    def mlp(self, *args):
        counts["mlp"] += 1
        return real_mlp(self, *args)

    monkeypatch.setattr(TritonKernelOps, "rms_norm_quant_fp8", norm)
    monkeypatch.setattr(Fp8Linear, "forward_quantized", linear)
    monkeypatch.setattr(Fp8SwiGLU, "forward_quantized_input", mlp)
    return counts


@pytest.mark.parametrize("dtype,stream", [(torch.float16, torch.float32), (torch.float16, None),
                                          (torch.float32, torch.float32)], ids=["fp16", "fp16_stream", "fp32"])
def test_fused_norm_quantization_gives_the_unfused_logits(calls, dtype, stream):
    fused, unfused = _models(dtype)
    fused.residual_dtype = unfused.residual_dtype = stream
    expected = all_logits(unfused, TOKENS)
    assert calls == {"norm": 0, "qkv": 0, "mlp": 0}
    got = all_logits(fused, TOKENS)
    assert calls == {"norm": 2 * LAYERS, "qkv": LAYERS, "mlp": LAYERS}  # layer 0's starts the stream
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_other_paths_are_kept(calls):
    fused, _ = _models(torch.float16)
    layer = fused.model.layers[0]
    handle = layer.self_attn.qkv_proj.register_forward_hook(lambda module, args, out: None)  # as LoRA would
    all_logits(fused, TOKENS)
    assert calls["norm"] == 2 * LAYERS - 1 and calls["qkv"] == LAYERS - 1
    handle.remove()
    calls.update(norm=0, qkv=0, mlp=0)
    norm, x = layer.post_attention_layernorm, torch.zeros(3, TINY.hidden_size, dtype=torch.float16)
    assert norm.quantizes_for(layer.mlp, x) and not norm.quantizes_for(layer.mlp, x.float())
    norm.compile(backend="eager")  # --compile: the compiled norm keeps its own path (not run here)
    assert not norm.quantizes_for(layer.mlp, x)
    all_logits(_with_ops(fused, TORCH_OPS), TOKENS)  # the torch back end never fuses
    assert calls == {"norm": 0, "qkv": 0, "mlp": 0}


@pytest.mark.parametrize("stream", [torch.float32, torch.float16, "residual"])
def test_the_ops_kernel_launch_is_norm_then_quantize(stream):
    """TritonKernelOps' CUDA branch (the fused kernel) against its norm then quantize_fp8_per_token, through the
    interpreter: the same bytes, the stream written where the norm writes it."""
    from sits.kernels.fp8_quantize import quantize_fp8_per_token

    torch.manual_seed(0)
    ops = TritonKernelOps()
    x, weight = torch.randn(5, 96).half(), (torch.randn(96) + 1).half()
    residual = torch.randn(5, 96) * 4 if stream == "residual" else None
    dtype = torch.float32 if stream == "residual" else stream
    got_fp8, got_scale, got_stream = ops.fused_rms_norm_quant_fp8(
        x, None if residual is None else residual.clone(), weight, 1e-5, dtype)
    normed, expected_stream = ops._norm_of_stream(x, residual, weight, 1e-5, dtype)
    expected_fp8, expected_scale = quantize_fp8_per_token(normed)
    assert torch.equal(got_stream, expected_stream) and got_stream.dtype == dtype
    assert (got_stream is x) == (stream == torch.float16)
    assert torch.equal(got_scale, expected_scale) and torch.equal(got_fp8.view(torch.uint8), expected_fp8.view(torch.uint8))


def test_only_w8a8_unsharded_models_enable_it(monkeypatch):
    loaded = random_loaded_model(TINY, TorchAttentionBackend(), "cpu", torch.float32, seed=0)
    weight_only = copy.deepcopy(loaded.model)
    sharded = copy.deepcopy(loaded.model)
    quantize_model(weight_only, "fp8", fp8_mode="weight-only")
    assert not any(m.accepts_quantized_input() for m in weight_only.modules() if isinstance(m, Fp8Linear))
    sharded.tensor_parallel = TensorParallelLayout(0, 2, 2, 1, 192, 0, 256)
    quantize_model(sharded, "fp8", fp8_mode="w8a8")
    assert not any(m.accepts_quantized_input() for m in sharded.modules() if isinstance(m, Fp8Linear))
    quantize_model(loaded.model, "fp8", fp8_mode="w8a8", fuse_activation_quant=False)
    monkeypatch.setenv(NORM_QUANT_ENV, "off")  # the unfused step in the same build, to measure it
    assert fuse_fp8_norm_quant(loaded.model) == 0
    monkeypatch.delenv(NORM_QUANT_ENV)
    assert fuse_fp8_norm_quant(loaded.model) == 2 * LAYERS  # qkv_proj and gate_up_proj of each layer
    assert not isinstance(loaded.model.model.layers[0].mlp, Fp8SwiGLU)  # a plain MLP still runs forward


@torch.inference_mode()
def _logits_on(model, tokens: list[int], device: torch.device) -> torch.Tensor:
    """all_logits on `device`: one prefill of `tokens` through the paged cache, [len(tokens), vocab] float32."""
    from tests.support.model_driver import PagedKVCache, PagedSequence, build_metadata

    cache = PagedKVCache(model, -(-len(tokens) // 16) + 1, 16)
    positions, metadata, _ = build_metadata(cache, [(PagedSequence(list(tokens)), len(tokens))], device)
    return model.compute_logits(model(torch.tensor(tokens, device=device), positions, cache.caches, metadata))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs fp8 tensor cores")
def test_fused_norm_quantization_on_the_gpu(calls):
    """The fused kernel on CUDA against the autotuned rms_norm then quantize_fp8_per_token: the same function
    (bit for bit where both norms sum their squares in the same order: at equal num_warps)."""
    device = torch.device("cuda")
    fused, unfused = _models(torch.bfloat16, device)
    expected = _logits_on(unfused, TOKENS, device)
    got = _logits_on(fused, TOKENS, device)
    assert calls == {"norm": 2 * LAYERS, "qkv": LAYERS, "mlp": LAYERS}
    assert ((got - expected).norm() / expected.norm()).item() < 1e-3
    print(f"fused vs unfused logits on the GPU: {int((got != expected).sum())} of {got.numel()} differ")
