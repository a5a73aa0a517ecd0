"""RMSNorm with an optional fused residual add, one row per program.

    rms_norm(x [..., N], weight [N], eps)                                 -> out [..., N]
    rms_norm(x [..., N], weight [N], eps, residual [..., N])              -> (out, new_residual)
    rms_norm(x [..., N], weight [N], eps, residual_out=stream [..., N])   -> (out, stream)

With a residual, `new_residual = x + residual` (rounded to residual's dtype: float32 for the model's
float32 residual stream) and `out = norm(new_residual)`: one pass reads x and residual and writes both
results, where eager PyTorch needs an add and four more kernels. `residual_out` names the buffer
new_residual is written to; it may be `residual` itself (an in-place update of the stream, no
allocation). With `residual_out` and no residual, the pass starts a stream: it writes x rounded to
residual_out's dtype (a decoder's embedding rows into its float32 stream) and normalizes that value,
the cast and the first norm in one launch. Arithmetic follows HF Llama's RMSNorm: the mean of squares
in float32, the normalized row rounded to out's dtype (x's by default), then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import (
    FLOAT_DTYPES,
    autotune,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    next_power_of_2,
    require,
)
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.reference import rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference"]

MAX_HIDDEN = 65536  # one row must fit one program's registers


# residual_out may be residual (an in-place stream): the timed runs of a new key must not add x again and again.
@autotune([triton.Config({}, num_warps=w) for w in (4, 8, 16)], triton.Config({}, num_warps=4),
          ["BLOCK_N", "HAS_RESIDUAL", "WRITE_RESIDUAL"], restore_value=["residual_out_ptr"])
@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    residual_ptr,
    residual_out_ptr,
    stride_x,
    stride_out,
    stride_res,
    stride_res_out,
    n_cols,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    WRITE_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if WRITE_RESIDUAL:
        if HAS_RESIDUAL:
            # Both loads come before the store: residual_out may be residual (this row, this program).
            res = tl.load(residual_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            x = x + res
        # Round the sum (or the stream's first value) to the storage dtype first: the unfused model
        # normalizes the rounded value.
        summed = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    rstd = tl.rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, optionally fused with `residual = x + residual`.

    Args:
        x: [..., N] float16 / bfloat16 / float32, last dimension contiguous.
        weight: [N], any float dtype.
        eps: added to the mean of squares.
        residual: optional [..., N], any float dtype (new_residual gets it unless residual_out is given).
        out: optional [..., N] output buffer, any float dtype; default x's dtype.
        residual_out: optional contiguous [..., N] buffer for new_residual, any float dtype; may be
            `residual` itself (updated in place). Without `residual` it receives x rounded to its dtype
            (a stream's first value), and out is the norm of that value.
    Returns:
        out [..., N], or (out, new_residual) when residual or residual_out is given.
    """
    check_tensor(x, "x", dtypes=FLOAT_DTYPES)
    require(x.dim() >= 1, "x must have at least one dimension")
    n_cols = x.shape[-1]
    require(0 < n_cols <= MAX_HIDDEN, f"x's last dimension must be in 1..{MAX_HIDDEN}, got {n_cols}")
    check_tensor(weight, "weight", ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape(weight, "weight", (n_cols,))
    check_inner_contiguous(x, "x")
    require(weight.is_contiguous(), "weight must be contiguous")
    x2d = x.reshape(-1, n_cols)
    if out is None:
        out = torch.empty_like(x)
    check_tensor(out, "out", dtypes=FLOAT_DTYPES, device=x.device)
    check_shape(out, "out", x.shape)
    require(out.is_contiguous(), "out must be contiguous")
    out2d = out.view(-1, n_cols)
    if residual is not None:
        check_tensor(residual, "residual", dtypes=FLOAT_DTYPES, device=x.device)
        check_shape(residual, "residual", x.shape)
        check_inner_contiguous(residual, "residual")
        res2d = residual.reshape(-1, n_cols)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    else:
        res2d = x2d  # unused: HAS_RESIDUAL is off
    if residual_out is not None:
        check_tensor(residual_out, "residual_out", dtypes=FLOAT_DTYPES, device=x.device)
        check_shape(residual_out, "residual_out", x.shape)
        require(residual_out.is_contiguous(), "residual_out must be contiguous")
        res_out2d = residual_out.view(-1, n_cols)
    else:
        res_out2d = x2d  # unused: WRITE_RESIDUAL is off
    rows = x2d.shape[0]
    if rows > 0:
        block_n = next_power_of_2(n_cols)
        _rms_norm_kernel[(rows,)](
            x2d, weight, out2d, res2d, res_out2d,
            x2d.stride(0), out2d.stride(0), res2d.stride(0), res_out2d.stride(0),
            n_cols, float(eps),
            BLOCK_N=block_n, HAS_RESIDUAL=residual is not None, WRITE_RESIDUAL=residual_out is not None,
            **pdl_launch_options(x.device),
        )  # fmt: skip
    return out if residual_out is None else (out, residual_out)
