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
        rms_norm(x, randn(64, dtype=torch.float32), 1e-5, residual=randn(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="x must have dtype"):
        rms_norm(torch.ones(2, 64, dtype=torch.int32, device=DEVICE), randn(64), 1e-5)
