"""INT8 weight-only GEMM (per-group scales) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.int8_gemm import (
    int8_weight_only_gemm,
    int8_weight_only_gemm_reference,
    quantize_weight_int8,
)
from sits.kernels.reference import dequantize_int8_weight
from tests.kernels.helpers import DEVICE, HALF_DTYPES, assert_close, randn


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize(
    "m,n,k,group_size",
    [(1, 64, 128, 128), (7, 96, 256, 64), (40, 64, 512, 128), (70, 64, 128, 32)],  # groups smaller than tiles too
    ids=["single_row", "decode", "split_k", "large_m_path"],
)
def test_int8_gemm_matches_reference(dtype, m, n, k, group_size):
    torch.manual_seed(m + k)
    x = randn(m, k, dtype=dtype)
    w_int8, scales = quantize_weight_int8(randn(n, k, dtype=torch.float32, scale=0.05), group_size)
    out = int8_weight_only_gemm(x, w_int8, scales, group_size)
    expected = int8_weight_only_gemm_reference(x, w_int8, scales, group_size)
    assert out.dtype == dtype and not out.isnan().any()
    assert_close(out, expected, dtype, scale=2.0)


def test_quantize_weight_int8_round_trips_within_half_a_step():
    torch.manual_seed(1)
    w = randn(16, 256, dtype=torch.float32)
    w_int8, scales = quantize_weight_int8(w, 128)
    assert w_int8.dtype == torch.int8 and scales.shape == (16, 2)
    restored = dequantize_int8_weight(w_int8, scales, 128, torch.float32)
    step = scales.repeat_interleave(128, dim=1)
    assert ((restored - w).abs() <= step / 2 + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 64, 512, 4096])
@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 4096), (4096, 14336)])
def test_int8_gemm_llama_shapes_gpu(m, n, k):
    torch.manual_seed(m)
    x = randn(m, k, dtype=torch.bfloat16)
    w_int8, scales = quantize_weight_int8(randn(n, k, dtype=torch.float32, scale=0.02))
    out = int8_weight_only_gemm(x, w_int8, scales)
    expected = int8_weight_only_gemm_reference(x, w_int8, scales)
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert error < 5e-3


def test_bad_input_raises_value_error():
    x = randn(2, 128, dtype=torch.float16)
    w_int8, scales = quantize_weight_int8(randn(8, 128, dtype=torch.float32))
    with pytest.raises(ValueError, match="multiple of group_size"):
        int8_weight_only_gemm(randn(2, 96, dtype=torch.float16), w_int8[:, :96], scales, 64)
    with pytest.raises(ValueError, match="scales must have shape"):
        int8_weight_only_gemm(x, w_int8, scales[:4])
    with pytest.raises(ValueError, match="in_features"):
        quantize_weight_int8(randn(4, 100, dtype=torch.float32))
    with pytest.raises(ValueError, match="x must have dtype"):
        int8_weight_only_gemm(x.float(), w_int8, scales)
    assert DEVICE.type in ("cpu", "cuda")
