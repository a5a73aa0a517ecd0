"""The model's element-wise hot ops (RMSNorm, RMSNorm fused with the residual add, SiLU·mul), swappable.

A decoder calls exactly one norm op per norm of the model and no separate add or cast: the stream's first
norm (`stream_rms_norm`: the embedding rows cast to the stream's dtype and normalized), then one
`add_rms_norm` per sublayer output (the add fused into the next norm, the final model norm included). A norm
that feeds an fp8 w8a8 projection may be `rms_norm_quant_fp8` instead: the same norm, its row quantized per
token to e4m3 for the projection (the quantization in the norm's launch with the Triton kernels).

`llama.py` calls these through a `KernelOps` object instead of spelling the math inline, so an
attention back end can bring fused GPU kernels for them (`AttentionBackend.kernel_ops()`) without
device branches in the model. `KernelOps` itself is the plain-PyTorch version, written to match HF
transformers' Llama bit for bit; `TritonKernelOps` runs the Triton kernels of `sits.kernels`, which
follow the same rounding steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sits.runtime.models.mixed_linear import mixed_linear


class KernelOps:
    """Plain PyTorch (any device, any float dtype): HF Llama's arithmetic."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [num_tokens, hidden] (the residual stream: float32, or the model dtype) → same shape in out_dtype
        (None: weight's, the model's); mean of squares in float32, the normalized row rounded to out_dtype
        before the scale, as HF Llama does for an input in the model dtype (float32 out_dtype: no rounding,
        the weight upcast; --activation-dtype float32)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out_dtype = out_dtype or weight.dtype
        return weight.to(out_dtype) * xf.to(out_dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): the sum in residual's dtype (x: a sublayer's output in the
        model dtype or float32; residual: the stream, float32 or the model dtype), normalized as that rounded
        sum, in out_dtype (None: weight's).

        The caller hands `residual` over: an implementation may write the sum into it (the Triton one does)
        and return it, so the tensor passed must not be read again."""
        summed = residual + x.to(residual.dtype)
        return self.rms_norm(summed, weight, eps, out_dtype), summed

    def stream_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, stream_dtype: torch.dtype,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a residual stream: (rms_norm(stream) in out_dtype (None: weight's), stream) with
        stream = x.to(stream_dtype).

        x: [num_tokens, hidden] in the model dtype (the embedding rows); the stream is x itself when
        stream_dtype is x's dtype, else a new tensor (exact: float32 holds every half-precision value)."""
        stream = x.to(stream_dtype)
        return self.rms_norm(stream, weight, eps, out_dtype), stream

    def rms_norm_quant_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
        stream_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`add_rms_norm` (residual given, handed over) or `stream_rms_norm` (None: x starts the stream in
        stream_dtype), its normed row then quantized per token for an fp8 w8a8 GEMM (as quantize_fp8_per_token):
        (normed_fp8 [num_tokens, hidden] float8_e4m3fn, scale [num_tokens, 1] float32, stream)."""
        from sits.kernels.reference import quantize_fp8_per_token_reference

        normed, stream = self._norm_of_stream(x, residual, weight, eps, stream_dtype)
        normed_fp8, scale = quantize_fp8_per_token_reference(normed)
        return normed_fp8, scale, stream

    def _norm_of_stream(self, x, residual, weight, eps, stream_dtype):
        if residual is not None:
            return self.add_rms_norm(x, residual, weight, eps)
        return self.stream_rms_norm(x, weight, eps, stream_dtype)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [num_tokens, 2F] (gate first) → silu(gate) * up, [num_tokens, F]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonKernelOps(KernelOps):
    """The Triton kernels: RMSNorm with the residual add (or the stream's cast) fused into one pass,
    SiLU·mul in one pass; one launch per op. `rms_norm_quant_fp8` on CUDA is one launch too (the
    quantization in the norm's epilogue, sits.kernels.rmsnorm_quant); elsewhere (the interpreter) the norm
    kernel, then the reference quantization, as an fp8 Fp8Linear off CUDA quantizes.

    They take float16 / bfloat16 / float32 with a contiguous last dimension (what the model's
    linear layers produce). `add_rms_norm` writes the new stream into `residual` when it is contiguous
    (no allocation). The kernel modules are imported once, at construction (they import triton), so an
    eager call costs no import lookup.
    """

    name = "triton"

    def __init__(self) -> None:
        from sits.kernels.rmsnorm import rms_norm
        from sits.kernels.rmsnorm_quant import rms_norm_quant_fp8
        from sits.kernels.silu_mul import silu_mul

        self._rms_norm = rms_norm
        self._rms_norm_quant_fp8 = rms_norm_quant_fp8
        self._silu_mul = silu_mul

    def rms_norm(self, x, weight, eps, out_dtype=None):
        out = torch.empty(x.shape, dtype=out_dtype or weight.dtype, device=x.device)
        return self._rms_norm(x, weight, eps, out=out)

    def add_rms_norm(self, x, residual, weight, eps, out_dtype=None):
        out = torch.empty(x.shape, dtype=out_dtype or weight.dtype, device=x.device)
        residual_out = residual if residual.is_contiguous() else None
        return self._rms_norm(x, weight, eps, residual=residual, out=out, residual_out=residual_out)

    def stream_rms_norm(self, x, weight, eps, stream_dtype, out_dtype=None):
        if stream_dtype == x.dtype:
            return self.rms_norm(x, weight, eps, out_dtype), x
        out = torch.empty(x.shape, dtype=out_dtype or weight.dtype, device=x.device)
        stream = torch.empty(x.shape, dtype=stream_dtype, device=x.device)
        return self._rms_norm(x, weight, eps, out=out, residual_out=stream)

    def rms_norm_quant_fp8(self, x, residual, weight, eps, stream_dtype):
        if not x.is_cuda or x.dtype != weight.dtype:  # the kernel rounds the normed row to x's dtype
            return super().rms_norm_quant_fp8(x, residual, weight, eps, stream_dtype)
        return self.fused_rms_norm_quant_fp8(x, residual, weight, eps, stream_dtype)

    def fused_rms_norm_quant_fp8(self, x, residual, weight, eps, stream_dtype):
        """`rms_norm_quant_fp8` in one launch of sits.kernels.rmsnorm_quant (any device: the interpreter's
        fp8 cast off CUDA; x in weight's dtype)."""
        if residual is not None:
            stream = residual if residual.is_contiguous() else None
            return self._rms_norm_quant_fp8(x, weight, eps, residual=residual, residual_out=stream)
        stream = None if stream_dtype == x.dtype else torch.empty(x.shape, dtype=stream_dtype, device=x.device)
        return self._rms_norm_quant_fp8(x, weight, eps, residual_out=stream)

    def silu_mul(self, gate_up):
        return self._silu_mul(gate_up)


TORCH_OPS = KernelOps()


def logits_float32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The output head's product, accumulated and returned in float32.

    hidden: [N, hidden_size] in the model dtype or float32; weight: [vocab, hidden_size] in the model dtype →
    [N, vocab] float32.

    Logits are never rounded to a half-precision type on the way: bfloat16 keeps 8 bits of mantissa, so
    logits near 25 land on a grid 0.125 apart, a top-2 gap of 0.08 (SmolLM2's first answer token to
    "What is the capital of France?") becomes an exact tie, and argmax then picks the lower token id.
    On CUDA a half-precision GEMM writes float32 directly (`torch.mm(..., out_dtype=torch.float32)`,
    the same cuBLAS call and cost); elsewhere both operands are upcast (CPU runs float32 by default). A
    float32 hidden beside a half-precision weight (--activation-dtype float32) goes through `mixed_linear`.
    """
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(hidden, weight)
    if hidden.is_cuda and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    if hidden.dtype == torch.float32:  # --activation-dtype float32: two half-precision parts of hidden
        return mixed_linear(hidden, weight)
    return F.linear(hidden.float(), weight.float())
