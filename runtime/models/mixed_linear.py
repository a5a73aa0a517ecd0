"""Float32 activations times half-precision weights: the projections of `--activation-dtype float32`.

    mixed_linear(x [..., K] float32, weight [N, K] bf16 / fp16, bias [N] | None) -> [..., N] float32

A bf16 model rounds every projection's input to 8 bits of mantissa. On real weights that rounding, not the
weights' nor the KV cache's, is what moves greedy near-ties away from a float32 model (benchmarks/RESULTS.md,
"Which bf16 operands cost agreement with float32"). Here the input stays float32 and the tensor cores still
multiply half-precision operands: x = hi + lo with hi = x rounded to the weight's dtype and lo = (x - hi)
rounded again, so hi + lo carries 16 bits of x's mantissa (bf16) and each product hi·w, lo·w is exact in the
float32 sums. On CUDA one launch writes both halves stacked (sits.kernels.split_halves), one GEMM of 2M rows
multiplies them ([hi; lo] against the weight, float32 output, `torch.mm(..., out_dtype=torch.float32)`), and a
third launch adds the two row blocks: twice the tensor-core work of the half-precision GEMM and the same weight
read, so a prefill step's GEMMs cost about twice as much and a decode step's (bound by the weight read) about
the same, plus two short launches a projection. Elsewhere (CPU) the weight is upcast and the product is plain
float32. At the decode batches the small-M table routes to a Triton kernel, `DecodeLinear` runs that kernel on
the float32 rows instead (sits.kernels.gemm_small_m: the same two terms, split per tile inside the launch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sits.kernels.launch_utils import HALF_DTYPES
from sits.kernels.split_halves import split_halves


def mixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) with x in float32 and the weight in half precision (see the module doc).

    Args:
        x: [..., K] float32.
        weight: [N, K] bfloat16 / float16 (nn.Linear layout).
        bias: optional [N], any float dtype (added in float32).
    Returns:
        [..., N] float32.
    """
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda and weight.dtype in HALF_DTYPES:
        m = rows.shape[0]
        both = torch.mm(split_halves(rows, weight.dtype), weight.t(), out_dtype=torch.float32)
        out = both[:m] + both[m:]
    else:
        out = F.linear(rows, weight.to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.reshape(*x.shape[:-1], weight.shape[0])
