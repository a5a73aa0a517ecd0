"""Rotary position embedding tables, shared by the model and every attention back end.

The table layout is the one `sits.runtime.attention.backend` documents: `cos_sin_cache` is
[max_positions, rotary_dim] float32, cos of each frequency in the first rotary_dim / 2 columns and
sin in the second half (rotate-half / NeoX pairing, as HF Llama uses). Triton kernels read the same
table, so it is built once here, in float32, whatever the model's dtype.
"""

from __future__ import annotations

import torch

# One table builder for the model and the kernels: it lives with the kernels because it is Triton-free
# and the fused RoPE kernel must read exactly the table the model would compute.
from sits.kernels.rope_tables import build_cos_sin_cache, rope_inverse_frequencies

__all__ = ["apply_rotary", "build_cos_sin_cache", "rope_inverse_frequencies"]


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, computed in float32 and returned in x's dtype.

    Args:
        x: [num_tokens, num_heads, head_dim]
        positions: [num_tokens] int64
        cos_sin_cache: [max_positions, rotary_dim] float32
    Returns:
        [num_tokens, num_heads, head_dim], a new tensor.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    xf = x.float()
    x1 = xf[..., :half]
    x2 = xf[..., half:rotary_dim]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if rotary_dim < x.shape[-1]:
        rotated = torch.cat([rotated, xf[..., rotary_dim:]], dim=-1)
    return rotated.to(x.dtype)
