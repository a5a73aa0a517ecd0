"""SiLU·mul, the gated MLP activation: out = silu(gate) * up in one pass.

    silu_mul(gate_up [..., 2F]) -> out [..., F], gate = gate_up[..., :F], up = gate_up[..., F:]
    silu_mul_quant_fp8(gate_up [T, 2F]) -> (out_fp8 [T, F] float8_e4m3fn, scale [T, 1] float32)

Arithmetic follows HF Llama (`act_fn(gate_proj(x)) * up_proj(x)`): silu in float32 rounded to the
input dtype, then the product rounded again, so the result matches eager PyTorch to within one
rounding step of the dtype (the GPU's fast exp may round the last float32 bit differently).

`silu_mul_quant_fp8` is the same activation with the per-token e4m3 quantization of the fp8 down
projection fused into its epilogue: each row's product (rounded to the input dtype, as silu_mul
stores it) gives its scale max(|row|, 1e-12) / 448 and is divided by it, rounded to nearest even,
exactly as fp8_quantize.quantize_fp8_per_token quantizes silu_mul's output. The product never
goes to memory: the step reads 2F values per token and writes F bytes plus one scale, where
silu_mul then quantize read 2F + F and wrote F values + F bytes. Rows up to MAX_SINGLE_PASS wide
(Llama-3-8B's 14,336 included: 32 float32 products per thread of 16 warps) stay in registers and
read gate_up once; wider rows compute the product twice, the second read mostly hitting L2.
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
from sits.kernels.reference import silu_mul_quant_fp8_reference, silu_mul_reference

__all__ = ["silu_mul", "silu_mul_quant_fp8", "silu_mul_quant_fp8_reference", "silu_mul_reference"]

BLOCK_F = 1024
MAX_GRID_Y = 65535
MAX_SINGLE_PASS = 16384
QUANT_CHUNK = 2048


@triton.jit
def _silu_mul_values(row_ptr, cols, mask, n_cols, dtype: tl.constexpr):
    """silu(gate) * up of the columns `cols` of one row, rounded to `dtype` twice (as HF Llama), in float32."""
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    product = _silu_mul_values(gate_up_ptr + row * stride_in, cols, mask, n_cols, dtype)
    tl.store(out_ptr + row * stride_out + cols, product.to(dtype), mask=mask)


@triton.jit
def _store_e4m3(values, scale, ptrs, mask):
    """values / scale rounded to nearest even and saturated to e4m3's +-448, stored at ptrs."""
    tl.store(ptrs, tl.clamp(tl.math.div_rn(values, scale), -448.0, 448.0).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(gate_up_ptr, stride_in, n_cols, out_ptr, stride_out, scale_ptr,
                           BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One row per program: the row's products, their absolute maximum, the scale, the e4m3 values."""
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    src = gate_up_ptr + token * stride_in
    dst = out_ptr + token * stride_out
    if SINGLE_PASS:  # the whole row in registers: computed once
        product = _silu_mul_values(src, offs, offs < n_cols, n_cols, gate_up_ptr.dtype.element_ty)
        scale = tl.maximum(tl.max(tl.abs(product), 0), 1e-12) * (1.0 / 448.0)
        _store_e4m3(product, scale, dst + offs, offs < n_cols)
    else:  # a pass for the maximum, a second (recomputing the products) for the values
        largest = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, n_cols, BLOCK):
            piece = _silu_mul_values(src, first + offs, first + offs < n_cols, n_cols, gate_up_ptr.dtype.element_ty)
            largest = tl.maximum(largest, tl.abs(piece))
        scale = tl.maximum(tl.max(largest, 0), 1e-12) * (1.0 / 448.0)
        for first in range(0, n_cols, BLOCK):
            piece = _silu_mul_values(src, first + offs, first + offs < n_cols, n_cols, gate_up_ptr.dtype.element_ty)
            _store_e4m3(piece, scale, dst + first + offs, first + offs < n_cols)
    tl.store(scale_ptr + token, scale)


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
            rows_in, rows_out, rows_in.stride(0), rows_out.stride(0), n_cols, BLOCK=BLOCK_F, num_warps=4,
            **pdl_launch_options(gate_up.device),
        )
    return out


def silu_mul_quant_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up, quantized to e4m3 per token in the same pass.

    Args:
        gate_up: [T, 2F] float16 / bfloat16 / float32, last dimension contiguous, gate first.
    Returns:
        (out_fp8 [T, F] float8_e4m3fn, scale [T, 1] float32) with out_fp8 * scale ~= silu_mul(gate_up).
    Raises:
        ValueError: wrong dtype, rank, layout or an odd width.
    """
    check_tensor(gate_up, "gate_up", ndim=2, dtypes=FLOAT_DTYPES)
    width = gate_up.shape[-1]
    require(width % 2 == 0 and width > 0, f"gate_up's last dimension must be even and positive, got {width}")
    check_inner_contiguous(gate_up, "gate_up")
    n_cols = width // 2
    out = gate_up.new_empty((gate_up.shape[0], n_cols), dtype=torch.float8_e4m3fn)
    scale = gate_up.new_empty((gate_up.shape[0], 1), dtype=torch.float32)
    in_registers = n_cols <= MAX_SINGLE_PASS  # else two passes over QUANT_CHUNK-wide pieces
    block = next_power_of_2(n_cols) if in_registers else QUANT_CHUNK
    if gate_up.shape[0]:
        _silu_mul_quant_kernel[(gate_up.shape[0],)](gate_up, gate_up.stride(0), n_cols, out, out.stride(0), scale,
                                                    BLOCK=block, SINGLE_PASS=in_registers,
                                                    num_warps=max(1, min(16, block // 256)),
                                                    **pdl_launch_options(gate_up.device))
    return out, scale
