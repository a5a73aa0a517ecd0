"""A float32 matrix as two half-precision parts, stacked for one GEMM: the input side of `mixed_linear`.

    split_halves(x [M, K] float32, dtype) -> out [2M, K] in dtype: out[:M] = hi, out[M:] = lo
        hi = x rounded to dtype, lo = (x - hi) rounded to dtype

hi + lo carries about twice the half-precision mantissa of x (16 bits with bf16), and both parts multiply a
half-precision weight exactly into float32 sums: `torch.mm(out, w.t(), out_dtype=torch.float32)`, then the two
row blocks added, is x @ w^T to about float32's precision (sits.runtime.models.mixed_linear). One launch writes
both parts (eager PyTorch takes four: the cast, the upcast, the difference, its cast, and a fifth to stack them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import HALF_DTYPES, check_inner_contiguous, check_tensor, require
from sits.kernels.pdl import pdl_launch_options, pdl_wait

__all__ = ["split_halves", "split_halves_reference"]

BLOCK_K = 1024  # columns a program splits


def split_halves_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The eager PyTorch version: x [M, K] float32 -> [2M, K] in dtype (hi rows, then lo rows)."""
    hi = x.to(dtype)
    return torch.cat([hi, (x - hi.float()).to(dtype)])


@triton.jit
def _split_halves_kernel(x_ptr, out_ptr, M, K, stride_x, stride_out, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    """Grid (M, cdiv(K, BLOCK)): row m's columns of this program, hi to out row m and lo to out row M + m."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    hi = x.to(out_ptr.dtype.element_ty)
    lo = (x - hi.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, hi, mask=mask)
    tl.store(out_ptr + (row + M) * stride_out + cols, lo, mask=mask)


def split_halves(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """hi and lo of x stacked: [2M, K] in `dtype` (see the module doc).

    Args:
        x: [M, K] float32, last dimension contiguous (any row stride).
        dtype: bfloat16 or float16.
    Returns:
        [2M, K] in dtype, rows [0, M) hi and [M, 2M) lo.
    Raises:
        ValueError: wrong dtype, rank or layout.
    """
    check_tensor(x, "x", ndim=2, dtypes=(torch.float32,))
    require(dtype in HALF_DTYPES, f"dtype must be bfloat16 or float16, got {dtype}")
    check_inner_contiguous(x, "x")
    m, k = x.shape
    out = torch.empty(2 * m, k, dtype=dtype, device=x.device)
    if m and k:
        grid = (m, triton.cdiv(k, BLOCK_K))
        _split_halves_kernel[grid](x, out, m, k, x.stride(0), out.stride(0), BLOCK=BLOCK_K, num_warps=4,
                                   **pdl_launch_options(x.device))
    return out
