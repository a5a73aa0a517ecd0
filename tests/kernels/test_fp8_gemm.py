"""FP8 activation quantization and the scaled e4m3 GEMM against their PyTorch references."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference, quantize_weight_fp8_per_channel
from sits.kernels.fp8_quantize import quantize_fp8_per_token, quantize_fp8_per_token_reference
from tests.kernels.helpers import DEVICE, ON_GPU, randn


def _quantized_operands(m, n, k):
    x = randn(m, k, dtype=torch.float32, scale=2.0)
    w = randn(n, k, dtype=torch.float32, scale=0.05)
    a_fp8, a_scale = quantize_fp8_per_token_reference(x)  # host quantization: exact in the interpreter
    w_fp8, w_scale = quantize_weight_fp8_per_channel(w)
    return a_fp8, a_scale, w_fp8, w_scale


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize(
    "m,n,k",
    [(1, 64, 64), (5, 96, 128), (33, 64, 256), (130, 64, 96)],
    ids=["single_row", "decode", "split_k", "large_m_path"],
)
def test_fp8_gemm_matches_reference(m, n, k):
    torch.manual_seed(m + n + k)
    a_fp8, a_scale, w_fp8, w_scale = _quantized_operands(m, n, k)
    out = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32)
    expected = fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32)
    assert out.shape == (m, n) and not out.isnan().any()
    if ON_GPU:  # fp8 tensor cores sum products in reduced precision between float32 promotions
        assert _relative_error(out, expected) < 2e-3
    else:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_fp8_gemm_accepts_flat_weight_scales_and_half_output():
    torch.manual_seed(1)
    a_fp8, a_scale, w_fp8, w_scale = _quantized_operands(4, 64, 64)
    out = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale.reshape(-1), out_dtype=torch.float16)
    expected = fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    assert _relative_error(out, expected) < 2e-3


def test_quantize_scales_match_reference():
    """Scales are exact even in the interpreter (its fp32->fp8 cast is what is broken, not the max)."""
    torch.manual_seed(2)
    x = randn(7, 300, dtype=torch.float16, scale=5.0)
    x[3] = 0  # an all-zero row gets the floor scale, not a division by zero
    _, scale = quantize_fp8_per_token(x)
    _, expected = quantize_fp8_per_token_reference(x)
    torch.testing.assert_close(scale, expected, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (37, 14336), (256, 100)])
def test_quantize_fp8_per_token_gpu(dtype, shape):
    torch.manual_seed(3)
    x = randn(*shape, dtype=dtype, scale=3.0)
    x_fp8, scale = quantize_fp8_per_token(x)
    expected_fp8, expected_scale = quantize_fp8_per_token_reference(x)
    torch.testing.assert_close(scale, expected_scale, atol=0, rtol=0)
    torch.testing.assert_close(x_fp8.float(), expected_fp8.float(), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 32, 100, 512, 2048])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 4096)])
def test_fp8_gemm_llama_shapes_gpu(m, n, k):
    torch.manual_seed(m)
    x = randn(m, k, dtype=torch.bfloat16)
    w = randn(n, k, dtype=torch.float32, scale=0.02)
    a_fp8, a_scale = quantize_fp8_per_token(x)
    w_fp8, w_scale = quantize_weight_fp8_per_channel(w)
    expected = fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale)
    for use_tma, fast_accum in ((True, False), (False, False), (True, True)):
        out = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, use_tma=use_tma, fast_accum=fast_accum)
        assert out.dtype == torch.bfloat16
        assert _relative_error(out, expected) < (5e-3 if fast_accum else 3e-3)
    # and the whole fp8 path stays close to the unquantized product
    assert _relative_error(out, x.float() @ w.t()) < 0.06


@pytest.mark.gpu
def test_fp8_gemm_matches_torch_scaled_mm_gpu():
    torch.manual_seed(5)
    a_fp8, a_scale, w_fp8, w_scale = _quantized_operands(512, 1024, 2048)
    out = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale)
    peer = torch._scaled_mm(a_fp8, w_fp8.t(), scale_a=a_scale, scale_b=w_scale.reshape(1, -1), out_dtype=torch.bfloat16)
    assert _relative_error(out, peer) < 5e-3


def test_bad_input_raises_value_error():
    a_fp8, a_scale, w_fp8, w_scale = _quantized_operands(2, 32, 64)
    with pytest.raises(ValueError, match="w_fp8 is"):
        fp8_gemm(a_fp8, a_scale, w_fp8[:, :32], w_scale)
    with pytest.raises(ValueError, match="a_fp8 must have dtype"):
        fp8_gemm(a_fp8.float(), a_scale, w_fp8, w_scale)
    with pytest.raises(ValueError, match="w_scale must be"):
        fp8_gemm(a_fp8, a_scale, w_fp8, w_scale[:5])
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight_fp8_per_channel(torch.ones(3, device=DEVICE))
    assert ON_GPU in (True, False)
