"""SiLU·mul against eager PyTorch (HF Llama's MLP activation)."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.silu_mul import silu_mul, silu_mul_reference
from tests.kernels.helpers import FLOAT_DTYPES, assert_close, poisoned, randn


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 128), (5, 2 * 1536), (2, 3, 2 * 1100)])
def test_silu_mul_matches_reference(dtype, shape):
    torch.manual_seed(0)
    gate_up = randn(*shape, dtype=dtype, scale=4.0)
    out = poisoned(*shape[:-1], shape[-1] // 2, dtype=dtype)
    assert silu_mul(gate_up, out=out) is out
    assert_close(out, silu_mul_reference(gate_up))


def test_odd_width_raises_value_error():
    with pytest.raises(ValueError, match="must be even"):
        silu_mul(randn(2, 7))


def test_empty_batch_returns_empty():
    assert silu_mul(randn(0, 8)).shape == (0, 4)
