"""`mixed_linear` on CUDA: float32 activations times bf16 / fp16 weights through two half-precision GEMM halves.

Against the float64 product of the same float32 x and half-precision weight, its error must be a small fraction of
what rounding x to the weight's dtype first (a half-precision model's GEMM) costs. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sits.runtime.models.mixed_linear import mixed_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_mixed_linear_is_near_the_exact_product(dtype, rows):
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=generator)
    weight = (torch.randn(1024, 4096, device="cuda", generator=generator) * 0.02).to(dtype)
    bias = (torch.randn(1024, device="cuda", generator=generator) * 0.02).to(dtype)
    exact = F.linear(x.double(), weight.double(), bias.double())
    out = mixed_linear(x, weight, bias)
    rounded = F.linear(x.to(dtype), weight, bias).double()  # x rounded first: a half-precision model's GEMM
    error, rounded_error = (out.double() - exact).abs().max().item(), (rounded - exact).abs().max().item()
    print(f"\nRESULT mixed_linear {str(dtype).removeprefix('torch.')} M={rows}: max error {error:.2e}, with x rounded "
          f"to {str(dtype).removeprefix('torch.')} {rounded_error:.2e}")
    assert out.dtype == torch.float32 and out.shape == (rows, 1024)
    assert error < rounded_error / 50
