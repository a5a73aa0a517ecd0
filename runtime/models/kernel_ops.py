"""The model's element-wise hot ops (RMSNorm, RMSNorm fused with the residual add, SiLU·mul), swappable.

`llama.py` calls these through a `KernelOps` object instead of spelling the math inline, so an
attention back end can bring fused GPU kernels for them (`AttentionBackend.kernel_ops()`) without
device branches in the model. `KernelOps` itself is the plain-PyTorch version, written to match HF
transformers' Llama bit for bit; `TritonKernelOps` runs the Triton kernels of `sits.kernels`, which
follow the same rounding steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KernelOps:
    """Plain PyTorch (any device, any float dtype): HF Llama's arithmetic."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [num_tokens, hidden] (the residual stream: float32, or the model dtype) → same shape in weight's
        dtype (the model's); mean of squares in float32, the normalized row rounded to weight's dtype before
        the scale, as HF Llama does for an input in the model dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(weight.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): the sum in residual's dtype (x: a sublayer's output in the
        model dtype; residual: the stream, float32 or the model dtype), normalized as that rounded sum."""
        summed = residual + x.to(residual.dtype)
        return self.rms_norm(summed, weight, eps), summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [num_tokens, 2F] (gate first) → silu(gate) * up, [num_tokens, F]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TritonKernelOps(KernelOps):
    """The Triton kernels: RMSNorm with the residual add fused into one pass, SiLU·mul in one pass.

    They take float16 / bfloat16 / float32 with a contiguous last dimension (what the model's
    linear layers produce).
    """

    name = "triton"

    def rms_norm(self, x, weight, eps):
        from sits.kernels.rmsnorm import rms_norm

        return rms_norm(x, weight, eps, out=torch.empty(x.shape, dtype=weight.dtype, device=x.device))

    def add_rms_norm(self, x, residual, weight, eps):
        from sits.kernels.rmsnorm import rms_norm

        out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
        return rms_norm(x, weight, eps, residual=residual, out=out)

    def silu_mul(self, gate_up):
        from sits.kernels.silu_mul import silu_mul

        return silu_mul(gate_up)


TORCH_OPS = KernelOps()


def logits_float32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The output head's product, accumulated and returned in float32.

    hidden: [N, hidden_size]; weight: [vocab, hidden_size], both in the model dtype → [N, vocab] float32.

    Logits are never rounded to a half-precision type on the way: bfloat16 keeps 8 bits of mantissa, so
    logits near 25 land on a grid 0.125 apart, a top-2 gap of 0.08 (SmolLM2's first answer token to
    "What is the capital of France?") becomes an exact tie, and argmax then picks the lower token id.
    On CUDA a half-precision GEMM writes float32 directly (`torch.mm(..., out_dtype=torch.float32)`,
    the same cuBLAS call and cost); elsewhere both operands are upcast (CPU runs float32 by default).
    """
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(hidden, weight)
    if hidden.is_cuda and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden.float(), weight.float())
