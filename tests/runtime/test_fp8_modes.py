"""fp8 weight modes (--fp8-mode auto | w8a8 | weight-only) and the accumulation table of the w8a8 GEMM.

On the CPU the layers run the kernels' PyTorch references (the same functions); the GPU kernels are
checked against them in tests/kernels. Fast accumulation exists on fp8 tensor cores only, so here the
table's lookups and its file format are tested, and the GEMM's modes on the GPU.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from torch import nn

from sits.kernels.fp8_accum import AccumEntry, AccumTable, backend_at
from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.commands.engine_args import add_engine_arguments, engine_config_from_args
from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.models.quantize import (
    Fp8Linear,
    Fp8SwiGLU,
    fp8_mode_of,
    quantization_of,
    quantize_model,
    resolve_fp8_mode,
)
from tests.runtime.test_quantize import TINY, all_logits, compare, tiny

CPU = torch.device("cpu")


def test_auto_is_w8a8_on_the_cpu_and_flags_force_either_mode():
    assert resolve_fp8_mode("auto", CPU) == "w8a8"
    assert resolve_fp8_mode("weight-only", CPU) == "weight-only"
    assert resolve_fp8_mode("w8a8", CPU) == "w8a8"
    with pytest.raises(ValueError, match="fp8 mode must be one of auto, w8a8, weight-only"):
        resolve_fp8_mode("w4a16", CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_follows_the_gpus_fp8_tensor_cores():
    device = torch.device("cuda")
    expected = "w8a8" if torch.cuda.get_device_capability() >= (8, 9) else "weight-only"
    assert resolve_fp8_mode("auto", device) == expected


def test_weight_only_keeps_activations_unquantized():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    x = torch.randn(5, 64) * torch.linspace(0.01, 4.0, 64)  # a wide spread: per-token e4m3 would round it
    weight_only = Fp8Linear.from_linear(linear, weight_only=True)
    w8a8 = Fp8Linear.from_linear(linear)
    dequantized = weight_only.weight.float() * weight_only.weight_scale[:, None]
    torch.testing.assert_close(weight_only(x), x @ dequantized.t() + linear.bias, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(w8a8(x), weight_only(x), rtol=1e-4, atol=1e-4)
    assert "weight-only" in repr(weight_only) and "w8a8" in repr(w8a8)


def test_quantize_model_weight_only_is_at_least_as_accurate_as_w8a8():
    tokens = [(7 * i + 3) % TINY.vocab_size for i in range(48)]
    model = tiny().model
    reference = all_logits(model, tokens)
    errors = {}
    for mode in ("weight-only", "w8a8"):
        quantized = copy.deepcopy(model)
        assert quantize_model(quantized, "fp8", fp8_mode=mode) == 2 * 4
        assert fp8_mode_of(quantized) == mode
        errors[mode] = compare(reference, all_logits(quantized, tokens))[1]
    assert errors["weight-only"] <= errors["w8a8"] and errors["weight-only"] < 0.05, errors
    assert fp8_mode_of(model) is None
    with pytest.raises(ValueError, match="fp8 mode must be one of"):
        quantize_model(copy.deepcopy(model), "fp8", fp8_mode="fast")


def test_the_flag_reaches_the_engine():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--quantization", "fp8", "--fp8-mode", "weight-only",
                              "--max-model-len", "64", "--num-blocks", "16", "--max-num-seqs", "2"])
    config = engine_config_from_args(args)
    assert config.model.fp8_mode == "weight-only"
    assert engine_config_from_args(parser.parse_args(["--device", "cpu"])).model.fp8_mode == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--fp8-mode", "int4"])
    with pytest.raises(ConfigError, match="--fp8-mode must be one of auto, w8a8, weight-only"):
        ModelConfig(fp8_mode="int4").validate()
    loaded = tiny()
    engine = LLMEngine.from_loaded(loaded, EngineConfig(model=config.model, cache=CacheConfig(num_blocks=16),
                                                        scheduler=SchedulerConfig(max_num_seqs=2)))
    assert fp8_mode_of(loaded.model) == "weight-only"
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert len(outputs[0].outputs[0].token_ids) == 3


def _entry(m_bucket, n, k, backend):
    return AccumEntry(m_bucket, n, k, backend)


def test_fp8_linear_takes_the_steps_of_its_own_shape():
    linear = nn.Linear(64, 48)
    table = AccumTable("NVIDIA H200", {(16, 48, 64): _entry(16, 48, 64, "triton_fast"),
                                       (256, 48, 64): _entry(256, 48, 64, "scaled_mm"),
                                       (16, 32, 64): _entry(16, 32, 64, "triton")})
    layer = Fp8Linear.from_linear(linear, accum=table)
    assert layer.gemm_steps == ((16, "triton_fast"), (256, "scaled_mm"))
    assert backend_at(layer.gemm_steps, 1) == layer.backend_for(100) == "triton_fast"
    assert layer.backend_for(200) == layer.backend_for(100000) == "scaled_mm"
    assert Fp8Linear.from_linear(linear, weight_only=True, accum=table).gemm_steps == ()
    assert Fp8Linear.from_linear(linear).gemm_steps == ()


def test_the_table_bucket_is_the_gemms_autotune_bucket():
    from sits.kernels.fp8_accum import M_BUCKET_CAP, m_bucket
    from sits.kernels.launch_utils import length_bucket

    for m in [0, 1, 2, 3, 31, 32, 33, 255, 256, 257, 4097, 65535, 65536, 65537, 1 << 20]:
        assert m_bucket(m) == length_bucket(m, cap=M_BUCKET_CAP), m


def _fused_and_unfused(device: str, dtype: torch.dtype):
    from sits.runtime.models.random_model import random_loaded_model

    loaded = random_loaded_model(TINY, TorchAttentionBackend(), device, dtype, seed=0)
    unfused = copy.deepcopy(loaded.model)
    quantize_model(loaded.model, "fp8", fp8_mode="w8a8")
    quantize_model(unfused, "fp8", fp8_mode="w8a8", fuse_activation_quant=False)
    return loaded.model, unfused


def test_w8a8_mlps_quantize_the_silu_mul_product_in_its_epilogue():
    fused, unfused = _fused_and_unfused("cpu", torch.float32)
    assert all(isinstance(layer.mlp, Fp8SwiGLU) for layer in fused.model.layers)
    assert isinstance(fused.model.layers[0].mlp.down_proj, Fp8Linear) and quantization_of(fused) == "fp8"
    assert not any(isinstance(m, Fp8SwiGLU) for m in unfused.modules())
    tokens = [(5 * i + 1) % TINY.vocab_size for i in range(40)]
    torch.testing.assert_close(all_logits(fused, tokens), all_logits(unfused, tokens), atol=0, rtol=0)
    weight_only = tiny().model
    quantize_model(weight_only, "fp8", fp8_mode="weight-only")
    assert not any(isinstance(m, Fp8SwiGLU) for m in weight_only.modules())  # bf16 activations: nothing to fuse


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs fp8 tensor cores")
def test_fused_activation_quant_is_the_unfused_function_on_the_gpu():
    fused, unfused = _fused_and_unfused("cuda", torch.bfloat16)
    x = torch.randn(37, TINY.hidden_size, device="cuda", dtype=torch.bfloat16)
    layer_fused, layer_unfused = fused.model.layers[0].mlp, unfused.model.layers[0].mlp
    with torch.no_grad():
        got, expected = layer_fused(x).float(), layer_unfused(x).float()
    # the same kernels' arithmetic but silu_mul's: the unfused model may run PyTorch's (its exp rounds
    # a product's last bit differently now and then, which can move one e4m3 value a step)
    assert ((got - expected).norm() / expected.norm()).item() < 2e-3
