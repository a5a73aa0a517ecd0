"""The decoder's fused add + RMSNorm with the fp8 w8a8 per-token activation quantization in its epilogue.

    rms_norm_quant_fp8(x [T, H], weight [H], eps)                              -> (out_fp8, scale, x)
    rms_norm_quant_fp8(x [T, H], weight [H], eps, residual [T, H])             -> (out_fp8, scale, new_residual)
    rms_norm_quant_fp8(x [T, H], weight [H], eps, residual_out=stream [T, H])  -> (out_fp8, scale, stream)

out_fp8 [T, H] float8_e4m3fn and scale [T, 1] float32 are what sits.kernels.rmsnorm.rms_norm's normed row
(in x's dtype, the model's) gives through sits.kernels.fp8_quantize.quantize_fp8_per_token: the normed row
rounded to x's dtype, scale = max(|row|, 1e-12) / 448 (a multiply by 1/448), each value divided by it
(an IEEE division), saturated to +-448 and rounded to nearest even. The residual stream is written exactly as
rms_norm writes it (residual and residual_out as there: x + residual rounded to the stream's dtype, or the
stream's first value x rounded to residual_out's dtype; residual_out may be residual itself). The normed row
never goes to memory: a norm feeding an fp8 w8a8 projection writes H bytes plus one scale per token, where the
norm then the quantization wrote H half values, read them back and wrote H bytes (one launch instead of two).

Rows up to MAX_SINGLE_PASS wide (every Llama's hidden size) stay in registers: the sum of squares is one
tl.sum over the row, as rms_norm's, so the result is bit for bit rms_norm's at the same num_warps (the
reduction's order follows the layout). Wider rows go in CHUNK-wide pieces: a pass writes the stream and sums
the squares, a second finds the largest normed value, a third quantizes; the later passes re-read the stream
(mostly from L2). Their sum of squares is added in another order than one tl.sum, so it may differ from
rms_norm's in the last float32 bit (the reference's tolerance, not bit identity).

Not autotuned: the hidden size alone gives the launch (`launch_config`), and no integer argument changes from
step to step (the row count is the grid), so the engine's start-up forwards (an eager forward per CUDA-graph
batch size, before its capture) compile every binary it launches later: one per stream case.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import (
    FLOAT_DTYPES,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    next_power_of_2,
    require,
)
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.reference import rms_norm_quant_fp8_reference

__all__ = ["rms_norm_quant_fp8", "rms_norm_quant_fp8_reference", "launch_config"]

MAX_SINGLE_PASS = 16384
CHUNK = 2048
MAX_HIDDEN = 65536  # as rms_norm's


@triton.jit
def _normed(stream, weight_ptr, cols, mask, rstd, dtype: tl.constexpr):
    """weight * (stream * rstd rounded to dtype), rounded to dtype, in float32: rms_norm's out values."""
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (stream * rstd).to(dtype).to(tl.float32)
    return (normed * weight).to(dtype).to(tl.float32)


@triton.jit
def _stream_piece(x_row, res_row, res_out_row, cols, mask, HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr):
    """The stream's values at `cols` in float32 (x, or x + residual rounded to the stream's dtype, stored)."""
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if WRITE_RESIDUAL:
        if HAS_RESIDUAL:  # both loads before the store: residual_out may be residual
            x = x + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
        summed = x.to(res_out_row.dtype.element_ty)
        tl.store(res_out_row + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    return x


@triton.jit
def _store_e4m3(values, scale, ptrs, mask):
    """values / scale rounded to nearest even and saturated to e4m3's +-448, stored at ptrs."""
    tl.store(ptrs, tl.clamp(tl.math.div_rn(values, scale), -448.0, 448.0).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, weight_ptr, residual_ptr, residual_out_ptr, out_ptr, scale_ptr,
    stride_x, stride_res, stride_res_out, stride_out, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr, SINGLE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    x_row, res_row = x_ptr + row * stride_x, residual_ptr + row * stride_res
    res_out_row, out_row = residual_out_ptr + row * stride_res_out, out_ptr + row * stride_out
    if SINGLE_PASS:  # the whole row in registers
        mask = offs < n_cols
        stream = _stream_piece(x_row, res_row, res_out_row, offs, mask, HAS_RESIDUAL, WRITE_RESIDUAL)
        rstd = tl.rsqrt(tl.sum(stream * stream, axis=0) / n_cols + eps)
        values = _normed(stream, weight_ptr, offs, mask, rstd, dtype)
        scale = tl.maximum(tl.max(tl.abs(values), 0), 1e-12) * (1.0 / 448.0)
        _store_e4m3(values, scale, out_row + offs, mask)
    else:
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, n_cols, BLOCK):
            piece = _stream_piece(x_row, res_row, res_out_row, first + offs, first + offs < n_cols,
                                  HAS_RESIDUAL, WRITE_RESIDUAL)
            squares += piece * piece
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / n_cols + eps)
        tl.debug_barrier()  # the stream this program stored is read back below
        src = res_out_row if WRITE_RESIDUAL else x_row
        largest = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, n_cols, BLOCK):
            mask = first + offs < n_cols
            piece = tl.load(src + first + offs, mask=mask, other=0.0).to(tl.float32)
            largest = tl.maximum(largest, tl.abs(_normed(piece, weight_ptr, first + offs, mask, rstd, dtype)))
        scale = tl.maximum(tl.max(largest, 0), 1e-12) * (1.0 / 448.0)
        for first in range(0, n_cols, BLOCK):
            mask = first + offs < n_cols
            piece = tl.load(src + first + offs, mask=mask, other=0.0).to(tl.float32)
            _store_e4m3(_normed(piece, weight_ptr, first + offs, mask, rstd, dtype), scale, out_row + first + offs,
                        mask)
    tl.store(scale_ptr + row, scale)


def launch_config(n_cols: int) -> tuple[int, int, bool]:
    """(BLOCK, num_warps, single pass) of a launch over rows n_cols wide (no autotuning: one binary per shape)."""
    single = n_cols <= MAX_SINGLE_PASS
    block = next_power_of_2(n_cols) if single else CHUNK
    return block, max(1, min(16, block // 256)), single


def rms_norm_quant_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of the stream (optionally x + residual, or x cast to the stream's dtype), quantized to e4m3 per token.

    Args:
        x: [T, H] float16 / bfloat16 / float32, last dimension contiguous; the normed row is rounded to its dtype.
        weight: [H], any float dtype, contiguous.
        eps: added to the mean of squares.
        residual: optional [T, H], any float dtype, last dimension contiguous (the stream before the add).
        residual_out: optional contiguous [T, H] buffer for the new stream, any float dtype; may be `residual`
            (updated in place). Without residual it receives x rounded to its dtype (the stream's start).
            Default with residual: a new tensor in residual's dtype.
    Returns:
        (out_fp8 [T, H] float8_e4m3fn, scale [T, 1] float32, stream [T, H]): stream is residual_out (or the new
        tensor), or x itself when neither residual nor residual_out is given.
    Raises:
        ValueError: wrong dtype, rank, shape, device or layout.
    """
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    rows, n_cols = x.shape
    require(0 < n_cols <= MAX_HIDDEN, f"x's last dimension must be in 1..{MAX_HIDDEN}, got {n_cols}")
    check_inner_contiguous(x, "x")
    check_tensor(weight, "weight", ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape(weight, "weight", (n_cols,))
    require(weight.is_contiguous(), "weight must be contiguous")
    if residual is not None:
        check_tensor(residual, "residual", dtypes=FLOAT_DTYPES, device=x.device)
        check_shape(residual, "residual", x.shape)
        check_inner_contiguous(residual, "residual")
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    if residual_out is not None:
        check_tensor(residual_out, "residual_out", dtypes=FLOAT_DTYPES, device=x.device)
        check_shape(residual_out, "residual_out", x.shape)
        require(residual_out.is_contiguous(), "residual_out must be contiguous")
    out = torch.empty(rows, n_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    stream = x if residual_out is None else residual_out
    res = x if residual is None else residual  # unused without HAS_RESIDUAL
    if rows > 0:
        block, warps, single = launch_config(n_cols)
        _rms_norm_quant_kernel[(rows,)](
            x, weight, res, stream, out, scale,
            x.stride(0), res.stride(0), stream.stride(0), out.stride(0), n_cols, float(eps),
            BLOCK=block, HAS_RESIDUAL=residual is not None, WRITE_RESIDUAL=residual_out is not None,
            SINGLE_PASS=single, num_warps=warps, **pdl_launch_options(x.device),
        )  # fmt: skip
    return out, scale, stream
