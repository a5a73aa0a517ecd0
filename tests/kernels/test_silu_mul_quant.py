"""SiLU·mul with the per-token e4m3 quantization fused into its epilogue.

Against the unfused kernels (silu_mul, then quantize_fp8_per_token: what the fp8 MLP ran before),
the result is identical bit for bit: the same arithmetic in one pass. Against the PyTorch reference
(silu_mul_reference, then quantize_fp8_per_token_reference) the scales agree to the input dtype's
rounding (the kernels' exp may round a product's last bit differently) and the e4m3 values agree
except where known differences explain it: Triton's interpreter mis-rounds in-kernel fp32 -> fp8
casts (upstream: a rounding carry into the exponent is lost, subnormals and ties round wrongly),
and a product one rounding step off may land on the other side of an e4m3 rounding boundary.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels.fp8_quantize import quantize_fp8_per_token
from sits.kernels.silu_mul import MAX_SINGLE_PASS, silu_mul, silu_mul_quant_fp8, silu_mul_quant_fp8_reference
from tests.kernels.e4m3_checks import assert_e4m3_matches_reference
from tests.kernels.helpers import FLOAT_DTYPES, randn


def _check(gate_up: torch.Tensor) -> None:
    got_fp8, got_scale = silu_mul_quant_fp8(gate_up)
    unfused_fp8, unfused_scale = quantize_fp8_per_token(silu_mul(gate_up))
    torch.testing.assert_close(got_scale, unfused_scale, atol=0, rtol=0)
    assert torch.equal(got_fp8.view(torch.uint8), unfused_fp8.view(torch.uint8))
    assert_e4m3_matches_reference(got_fp8, got_scale, *silu_mul_quant_fp8_reference(gate_up))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 2), (5, 2 * 96), (3, 2 * (MAX_SINGLE_PASS + 808))],
                         ids=["one_value", "one_pass", "two_passes"])
def test_silu_mul_quant_matches_silu_mul_then_quantize(dtype, rows, width):
    torch.manual_seed(rows + width)
    gate_up = randn(rows, width, dtype=dtype, scale=4.0)
    gate_up[0, : width // 2] = 0  # a zero row product: the floor scale, not a division by zero
    out, scale = silu_mul_quant_fp8(gate_up)
    assert out.dtype == torch.float8_e4m3fn and out.shape == (rows, width // 2) and scale.shape == (rows, 1)
    assert scale[0].item() == pytest.approx(1e-12 / 448)
    _check(gate_up)


def test_a_strided_batch_and_bad_input():
    torch.manual_seed(1)
    wide = randn(4, 2 * 64 + 32, dtype=torch.float16, scale=2.0)
    gate_up = wide[:, : 2 * 64]  # rows with a stride past their width
    _check(gate_up)
    out, scale = silu_mul_quant_fp8(randn(0, 8, dtype=torch.float16))
    assert out.shape == (0, 4) and scale.shape == (0, 1)
    with pytest.raises(ValueError, match="must be even"):
        silu_mul_quant_fp8(randn(2, 7, dtype=torch.float16))
    with pytest.raises(ValueError, match="must have 2 dimensions"):
        silu_mul_quant_fp8(randn(2, 3, 8, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 300])
@pytest.mark.parametrize("intermediate", [1536, 14336])
def test_silu_mul_quant_llama_shapes_gpu(tokens, intermediate):
    torch.manual_seed(tokens)
    _check(randn(tokens, 2 * intermediate, dtype=torch.bfloat16, scale=3.0))
