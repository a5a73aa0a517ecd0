"""SiLU·mul, the gated MLP activation: out = silu(gate) * up in one pass.

    silu_mul(gate_up [..., 2F]) -> out [..., F], gate = gate_up[..., :F], up = gate_up[..., F:]

Arithmetic follows HF Llama (`act_fn(gate_proj(x)) * up_proj(x)`): silu in float32 rounded to the
input dtype, then the product rounded again, so the result matches eager PyTorch to within one
rounding step of the dtype (the GPU's fast exp may round the last float32 bit differently).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import FLOAT_DTYPES, check_inner_contiguous, check_shape, check_tensor, require
from sits.kernels.reference import silu_mul_reference

__all__ = ["silu_mul", "silu_mul_reference"]

BLOCK_F = 1024
MAX_GRID_Y = 65535


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    row_in = gate_up_ptr + row * stride_in
    gate = tl.load(row_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up.

    Args:
        gate_up: [..., 2F] float16 / bfloat16 / float32, last dimension contiguous, gate first.
        out: optional [..., F] buffer in gate_up's dtype.
    Returns:
        [..., F] in gate_up's dtype.
    """
    check_tensor(gate_up, "gate_up", dtypes=FLOAT_DTYPES)
    require(gate_up.dim() >= 1, "gate_up must have at least one dimension")
    width = gate_up.shape[-1]
    require(width % 2 == 0 and width > 0, f"gate_up's last dimension must be even and positive, got {width}")
    check_inner_contiguous(gate_up, "gate_up")
    n_cols = width // 2
    out_shape = (*gate_up.shape[:-1], n_cols)
    if out is None:
        out = torch.empty(out_shape, dtype=gate_up.dtype, device=gate_up.device)
    check_tensor(out, "out", dtypes=(gate_up.dtype,), device=gate_up.device)
    check_shape(out, "out", out_shape)
    require(out.is_contiguous(), "out must be contiguous")
    rows_in = gate_up.reshape(-1, width)
    rows_out = out.view(-1, n_cols)
    col_blocks = triton.cdiv(n_cols, BLOCK_F)
    require(col_blocks <= MAX_GRID_Y, f"gate_up's last dimension is too large ({width})")
    if rows_in.shape[0] > 0:
        _silu_mul_kernel[(rows_in.shape[0], col_blocks)](
            rows_in, rows_out, rows_in.stride(0), rows_out.stride(0), n_cols, BLOCK=BLOCK_F, num_warps=4
        )
    return out
