"""RMSNorm with the per-token e4m3 quantization fused into its epilogue (the norm before an fp8 w8a8 projection).

Against the unfused kernels (rms_norm, then quantize_fp8_per_token: what the fp8 layer ran before) the result
is identical bit for bit, the residual stream included: the same arithmetic in one pass (on a GPU both kernels
run at the same num_warps, as a tl.sum's order follows the layout; the interpreter's sums do not). Rows wider
than MAX_SINGLE_PASS sum their squares in pieces: their stream is still exact, their normed values may be one
rounding step off where the sum's last bit differs. Against the
PyTorch reference the scales agree to the dtype's rounding and the e4m3 values agree except where the
interpreter's in-kernel fp32 -> fp8 cast is known to slip (see e4m3_checks.py).
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels.fp8_quantize import quantize_fp8_per_token
from sits.kernels.launch_utils import next_power_of_2
from sits.kernels.rmsnorm import _rms_norm_kernel, rms_norm
from sits.kernels.rmsnorm_quant import (
    MAX_SINGLE_PASS,
    launch_config,
    rms_norm_quant_fp8,
    rms_norm_quant_fp8_reference,
)
from tests.kernels.e4m3_checks import assert_e4m3_matches_reference, interpreter_slips
from tests.kernels.helpers import FLOAT_DTYPES, ON_GPU, poisoned, randn


def _pinned_rms_norm(x, weight, eps, residual, residual_out):
    """rms_norm's kernel launched at the fused kernel's num_warps (on a GPU its autotuner may pick others)."""
    out = torch.empty_like(x)
    n_cols = x.shape[1]
    res = x if residual is None else residual
    res_out = x if residual_out is None else residual_out
    _rms_norm_kernel.fn[(x.shape[0],)](
        x, weight, out, res, res_out, x.stride(0), out.stride(0), res.stride(0), res_out.stride(0), n_cols, eps,
        BLOCK_N=next_power_of_2(n_cols), HAS_RESIDUAL=residual is not None, WRITE_RESIDUAL=residual_out is not None,
        num_warps=launch_config(n_cols)[1])
    return out


def _check(x, weight, residual=None, stream_dtype=None, eps=1e-5):
    """The fused call against rms_norm + quantize_fp8_per_token (bit for bit) and the reference."""
    stream_out = None
    if residual is not None:
        stream_out = residual.clone()  # in place, as the decoder calls it
    elif stream_dtype is not None:
        stream_out = poisoned(*x.shape, dtype=stream_dtype)
    unfused_stream = None if stream_out is None else torch.empty_like(stream_out)
    fused_residual = None if residual is None else stream_out
    got_fp8, got_scale, got_stream = rms_norm_quant_fp8(x, weight, eps, residual=fused_residual, residual_out=stream_out)
    if ON_GPU and x.shape[1] <= MAX_SINGLE_PASS:
        normed = _pinned_rms_norm(x, weight, eps, residual, unfused_stream)
    else:
        normed = rms_norm(x, weight, eps, residual=residual, out=torch.empty_like(x), residual_out=unfused_stream)
        normed = normed[0] if isinstance(normed, tuple) else normed
    if unfused_stream is not None:
        assert got_stream is stream_out and torch.equal(got_stream, unfused_stream)
    else:
        assert got_stream is x
    unfused_fp8, unfused_scale = quantize_fp8_per_token(normed)
    if x.shape[1] <= MAX_SINGLE_PASS:
        torch.testing.assert_close(got_scale, unfused_scale, atol=0, rtol=0)
        assert torch.equal(got_fp8.view(torch.uint8), unfused_fp8.view(torch.uint8))
    else:  # the chunked sum of squares may round its last bit otherwise: a normed value one rounding step off
        torch.testing.assert_close(got_scale, unfused_scale, atol=0, rtol=2.0**-7)
        differ = got_fp8.view(torch.uint8) != unfused_fp8.view(torch.uint8)
        assert differ.float().mean() < 1e-3 and interpreter_slips(got_fp8, unfused_fp8)[differ].all()
    expected_fp8, expected_scale, expected_stream = rms_norm_quant_fp8_reference(x, residual, weight, eps, stream_dtype)
    torch.testing.assert_close(got_stream, expected_stream, atol=0, rtol=0)
    assert_e4m3_matches_reference(got_fp8, got_scale, expected_fp8, expected_scale)


WIDTHS = [pytest.param(1, id="one_value"), pytest.param(96, id="one_pass"),
          pytest.param(MAX_SINGLE_PASS + 808, id="three_passes")]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_norm_quant_matches_norm_then_quantize(dtype, width):
    torch.manual_seed(width)
    x = randn(3, width, dtype=dtype, scale=2.0)
    weight = randn(width, dtype=dtype) + 1.0
    _check(x, weight, residual=randn(3, width, dtype=torch.float32, scale=4.0))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_a_stream_started_in_the_norm(dtype, width):
    torch.manual_seed(width + 1)
    x = randn(4, width, dtype=dtype, scale=3.0)
    weight = randn(width, dtype=dtype) + 1.0
    _check(x, weight, stream_dtype=torch.float32)  # layer 0: the embedding rows into the float32 stream
    _check(x, weight)  # a stream in the model dtype: x itself, nothing written


def test_a_residual_in_the_model_dtype_and_a_zero_row():
    torch.manual_seed(2)
    x = randn(5, 320, dtype=torch.float16)
    residual = randn(5, 320, dtype=torch.float16, scale=2.0)
    x[1], residual[1] = 0, 0  # a zero row: the floor scale, not a division by zero
    _check(x, randn(320, dtype=torch.float16) + 1.0, residual=residual)
    weight = randn(320, dtype=torch.float16)
    _, scale, stream = rms_norm_quant_fp8(x, weight, 1e-5, residual=residual)  # a new stream tensor
    assert scale[1].item() == pytest.approx(1e-12 / 448)
    assert stream is not residual and stream.dtype == torch.float16
    torch.testing.assert_close(stream, rms_norm(x, weight, 1e-5, residual=residual)[1], atol=0, rtol=0)


def test_a_strided_x_and_no_rows():
    torch.manual_seed(3)
    wide = randn(4, 96, dtype=torch.float16)
    _check(wide[:, :64], randn(64, dtype=torch.float16) + 1.0, residual=randn(4, 64, dtype=torch.float32))
    out, scale, stream = rms_norm_quant_fp8(randn(0, 8, dtype=torch.float16), randn(8, dtype=torch.float16), 1e-5)
    assert out.shape == (0, 8) and out.dtype == torch.float8_e4m3fn and scale.shape == (0, 1)


def test_bad_input_is_a_value_error():
    x, weight = randn(2, 8, dtype=torch.float16), randn(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="must have 2 dimensions"):
        rms_norm_quant_fp8(x.view(2, 2, 4), weight, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_quant_fp8(x, randn(7, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_quant_fp8(x, weight, 1e-5, residual=randn(2, 7))
    with pytest.raises(ValueError, match="residual_out must be contiguous"):
        rms_norm_quant_fp8(x, weight, 1e-5, residual_out=randn(8, 2).t())
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_quant_fp8(x.to(torch.int32), weight, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 448])
@pytest.mark.parametrize("hidden", [576, 4096, 8192])
def test_rms_norm_quant_llama_shapes_gpu(tokens, hidden):
    torch.manual_seed(tokens)
    x = randn(tokens, hidden, dtype=torch.bfloat16, scale=3.0)
    weight = randn(hidden, dtype=torch.bfloat16) + 1.0
    _check(x, weight, residual=randn(tokens, hidden, dtype=torch.float32, scale=8.0))
    _check(x, weight, stream_dtype=torch.float32)
