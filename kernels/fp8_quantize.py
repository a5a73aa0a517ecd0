"""Dynamic per-token FP8 (e4m3) activation quantization, one row per program.

    quantize_fp8_per_token(x [M, K]) -> (x_fp8 [M, K] float8_e4m3fn, scale [M, 1] float32)

scale = max(|x_row|, 1e-12) * (1 / 448), x_fp8 = saturate(x / scale) rounded to nearest even, the
same float32 arithmetic as the reference (an IEEE division for the values), so both round alike. Rows up to
MAX_SINGLE_PASS wide are held in registers and read once; wider rows are read twice (the second
read mostly hits L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import (
    FLOAT_DTYPES,
    check_inner_contiguous,
    check_tensor,
    next_power_of_2,
    require,
)
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.reference import quantize_fp8_per_token_reference

__all__ = ["quantize_fp8_per_token", "quantize_fp8_per_token_reference"]

MAX_SINGLE_PASS = 8192
CHUNK = 2048


@triton.jit
def _quantize_row_chunk(x, scale, out_ptrs, mask):
    quantized = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
    tl.store(out_ptrs, quantized.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_fp8_per_token_kernel(
    x_ptr, out_ptr, scale_ptr, stride_x, stride_out, n_cols,
    BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    if SINGLE_PASS:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        running = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            chunk = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
            running = tl.maximum(running, tl.abs(chunk))
        amax = tl.max(running, 0)
    scale = tl.maximum(amax, 1e-12) * (1.0 / 448.0)
    tl.store(scale_ptr + row, scale)
    if SINGLE_PASS:
        _quantize_row_chunk(x, scale, out_row + cols, mask)
    else:
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            chunk = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            _quantize_row_chunk(chunk, scale, out_row + start + cols, mask)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes each row of x to e4m3 with its own scale.

    Args:
        x: [M, K] float16 / bfloat16 / float32, last dimension contiguous.
    Returns:
        (x_fp8 [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~= x_fp8 * scale.
    """
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    check_inner_contiguous(x, "x")
    rows, n_cols = x.shape
    require(n_cols > 0, "x must have at least one column")
    x_fp8 = torch.empty(rows, n_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return x_fp8, scale
    single = n_cols <= MAX_SINGLE_PASS
    block = next_power_of_2(n_cols) if single else CHUNK
    _quantize_fp8_per_token_kernel[(rows,)](
        x, x_fp8, scale, x.stride(0), x_fp8.stride(0), n_cols,
        BLOCK=block, SINGLE_PASS=single, num_warps=max(1, min(16, block // 256)), **pdl_launch_options(x.device),
    )  # fmt: skip
    return x_fp8, scale
