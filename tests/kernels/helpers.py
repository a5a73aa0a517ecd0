"""Shared pieces of the kernel tests: the device, dtype parameters and per-dtype tolerances.

On a machine without CUDA the kernels run through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1). The interpreter computes bf16 on raw bits and mis-rounds in-kernel fp32->fp8
casts, so bf16 and in-kernel fp8 cases carry the `gpu` mark and run on a GPU only.
"""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

# bf16 runs on the GPU only; fp16 and fp32 run everywhere.
FLOAT_DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
    pytest.param(torch.float32, id="fp32"),
]
HALF_DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]

# Elementwise tolerances (atol, rtol) for a result rounded to the dtype once or twice.
TOLERANCES = {
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float32: (1e-5, 1e-5),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale=1.0):
    """torch.testing.assert_close with the per-dtype tolerances (optionally widened by `scale`)."""
    atol, rtol = TOLERANCES[dtype or expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol * scale, equal_nan=False)


def randn(*shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    """Random normal data on the test device, drawn on the CPU so every machine sees the same values.

    Never zeros: they hide unwritten outputs and wrong indexing.
    """
    return (torch.randn(*shape) * scale).to(dtype=dtype, device=DEVICE)


def poisoned(*shape, dtype) -> torch.Tensor:
    """An output buffer filled with NaN, so any element a kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
