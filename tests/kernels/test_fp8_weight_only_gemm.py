"""FP8 weight-only GEMM (e4m3 weights dequantized in the load, bf16/fp16 activations) against its reference.

Decode shapes (M <= 64: split-K, swapped operands under the interpreter) and prefill shapes (the
large-M kernel), whole and ragged K tiles. Weights are quantized on the host (the interpreter's
in-kernel fp32->fp8 cast is broken; its fp8 loads and fp8->fp16 conversion are exact).
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels.fp8_weight_only_gemm import DECODES, fp8_weight_only_gemm, fp8_weight_only_gemm_reference
from sits.kernels.quantization import quantize_weight_fp8_per_channel
from tests.kernels.helpers import DEVICE, HALF_DTYPES, assert_close, randn


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_weight_fp8_per_channel(randn(n, k, dtype=torch.float32, scale=0.05))


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 64, 128), (8, 96, 256), (32, 64, 80), (70, 64, 128), (130, 48, 96)],
    ids=["decode_m1", "decode_m8_split_k", "decode_m32_ragged_k", "prefill", "prefill_ragged"],
)
def test_fp8_weight_only_gemm_matches_reference(decode, dtype, m, n, k):
    torch.manual_seed(m + n + k)
    x = randn(m, k, dtype=dtype)
    w_fp8, w_scale = _weights(n, k)
    out = fp8_weight_only_gemm(x, w_fp8, w_scale, decode=decode)
    expected = fp8_weight_only_gemm_reference(x, w_fp8, w_scale)
    assert out.shape == (m, n) and out.dtype == dtype and not out.isnan().any()
    assert_close(out, expected, dtype, scale=2.0)


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("rows", [8, 256], ids=["split_k", "large_m"])
def test_every_e4m3_code_decodes_exactly(decode, rows):
    """The identity times a weight holding all 254 finite e4m3 codes (and two zeros for the NaNs)
    gives each code's value back, exactly in float16: normals, subnormals, signs."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0
    w_fp8 = codes.view(torch.float8_e4m3fn).reshape(16, 16).repeat(1, 16).contiguous().to(DEVICE)  # [16, 256]
    x = torch.eye(256, dtype=torch.float16, device=DEVICE)[:rows]
    out = fp8_weight_only_gemm(x, w_fp8, torch.ones(16, device=DEVICE), decode=decode)
    assert torch.equal(out, w_fp8.float().t()[:rows].to(torch.float16))


def test_the_reference_is_the_dequantized_product_and_close_to_full_precision():
    torch.manual_seed(3)
    x = randn(4, 256, dtype=torch.float32)
    w = randn(32, 256, dtype=torch.float32, scale=0.05)
    w_fp8, w_scale = quantize_weight_fp8_per_channel(w)
    out = fp8_weight_only_gemm_reference(x, w_fp8, w_scale.reshape(-1))
    torch.testing.assert_close(out, x @ (w_fp8.float() * w_scale).t(), atol=1e-5, rtol=1e-5)
    assert ((out - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.05  # e4m3: 3 mantissa bits


def test_empty_batch_and_bad_input():
    w_fp8, w_scale = _weights(32, 64)
    assert fp8_weight_only_gemm(randn(0, 64, dtype=torch.float16), w_fp8, w_scale).shape == (0, 32)
    with pytest.raises(ValueError, match="w_fp8 is"):
        fp8_weight_only_gemm(randn(2, 32, dtype=torch.float16), w_fp8, w_scale)
    with pytest.raises(ValueError, match="x must have dtype"):
        fp8_weight_only_gemm(randn(2, 64, dtype=torch.float32), w_fp8, w_scale)
    with pytest.raises(ValueError, match="w_fp8 must have dtype"):
        fp8_weight_only_gemm(randn(2, 64, dtype=torch.float16), w_fp8.float(), w_scale)
    with pytest.raises(ValueError, match="w_scale must be"):
        fp8_weight_only_gemm(randn(2, 64, dtype=torch.float16), w_fp8, w_scale[:5])
    with pytest.raises(ValueError, match="decode must be one of"):
        fp8_weight_only_gemm(randn(2, 64, dtype=torch.float16), w_fp8, w_scale, decode="lut")
    assert DEVICE.type in ("cpu", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 32, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 4000)])
def test_fp8_weight_only_gemm_llama_shapes_gpu(m, n, k):
    """bf16 on the GPU: float32 sums in another order than the reference's, one bf16 rounding."""
    torch.manual_seed(m)
    w = randn(n, k, dtype=torch.float32, scale=0.02)
    x = randn(m, k, dtype=torch.bfloat16)
    w_fp8, w_scale = quantize_weight_fp8_per_channel(w)
    expected = fp8_weight_only_gemm_reference(x, w_fp8, w_scale)
    for decode in DECODES if torch.cuda.get_device_capability() >= (8, 9) else ("bits",):
        got = fp8_weight_only_gemm(x, w_fp8, w_scale, decode=decode).float()
        assert _relative_error(got, expected) < 5e-3, decode
        assert _relative_error(got, x.float() @ w.t()) < 0.05  # e4m3 weights against the unquantized product
