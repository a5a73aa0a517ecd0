"""RMSNorm (with and without the fused residual add) against HF Llama's formula."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.rmsnorm import rms_norm, rms_norm_reference
from tests.kernels.helpers import DEVICE, FLOAT_DTYPES, assert_close, poisoned, randn


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 5, 1000)])
def test_rms_norm_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x = randn(*shape, dtype=dtype, scale=3.0)
    weight = randn(shape[-1], dtype=dtype) + 1.0
    out = poisoned(*shape, dtype=dtype)
    result = rms_norm(x, weight, 1e-5, out=out)
    assert result is out
    assert_close(out, rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(5, 128), (2, 3, 576)])
def test_fused_residual_add(dtype, shape):
    torch.manual_seed(1)
    x = randn(*shape, dtype=dtype)
    residual = randn(*shape, dtype=dtype, scale=4.0)
    weight = randn(shape[-1], dtype=dtype)
    residual_before = residual.clone()
    out, new_residual = rms_norm(x, weight, 1e-6, residual=residual)
    expected_out, expected_residual = rms_norm_reference(x, weight, 1e-6, residual=residual_before)
    # The sum is rounded once to the dtype in both, so it matches exactly.
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    assert_close(out, expected_out)
    torch.testing.assert_close(residual, residual_before, atol=0, rtol=0)  # the input is left alone


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_float32_residual_stream_with_half_input_and_output(dtype):
    """A model keeping its residual stream in float32: x (a sublayer's output) and out in the model dtype."""
    torch.manual_seed(4)
    x = randn(5, 576, dtype=dtype)
    residual = randn(5, 576, dtype=torch.float32, scale=4.0)
    weight = randn(576, dtype=dtype) + 1.0
    out, new_residual = rms_norm(x, weight, 1e-6, residual=residual, out=poisoned(5, 576, dtype=dtype))
    expected_residual = x.float() + residual  # one float32 add, never rounded to the half dtype
    assert (out.dtype, new_residual.dtype) == (dtype, torch.float32)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    assert_close(out, rms_norm_reference(expected_residual.to(dtype), weight, 1e-6), dtype=dtype, scale=2.0)
    unfused = rms_norm(expected_residual, weight, 1e-6, out=torch.empty_like(x))  # a float32 x, half out
    torch.testing.assert_close(out, unfused, atol=0, rtol=0)


def test_float32_weight_with_half_input_keeps_input_dtype():
    torch.manual_seed(2)
    x = randn(4, 96, dtype=torch.float16)
    weight = randn(96, dtype=torch.float32)
    out = rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float16
    assert_close(out, rms_norm_reference(x, weight, 1e-5))


def test_strided_rows_are_read_through_their_stride():
    torch.manual_seed(3)
    wide = randn(6, 256, dtype=torch.float32)
    x = wide[:, :128]  # rows 256 apart
    weight = randn(128, dtype=torch.float32)
    assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))


def test_bad_input_raises_value_error():
    x = randn(2, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, randn(32, dtype=torch.float32), 1e-5)
    with pytest.raises(ValueError, match="residual must have dtype"):
        rms_norm(x, randn(64), 1e-5, residual=torch.ones(2, 64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="x must have dtype"):
        rms_norm(torch.ones(2, 64, dtype=torch.int32, device=DEVICE), randn(64), 1e-5)
