"""Rotary position embedding tables, shared by the model and every attention back end.

The table layout is the one `sits.runtime.attention.backend` documents: `cos_sin_cache` is
[max_positions, rotary_dim] float32, cos of each frequency in the first rotary_dim / 2 columns and
sin in the second half (rotate-half / NeoX pairing, as HF Llama uses). Triton kernels read the same
table, so it is built once here, in float32, whatever the model's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(rotary_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """The rotation speed of each pair of channels, in radians per position.

    Args:
        rotary_dim: channels that rotate (head_dim for every supported family).
        theta: the RoPE base.
        rope_scaling: None, or {"rope_type": "linear" | "llama3" | "freq_factors", ...} in HF spelling.
    Returns:
        [rotary_dim // 2] float32.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope_scaling)
    if rope_type == "freq_factors":
        # GGUF files store Llama 3.1's scaling as a per-frequency divisor (`rope_freqs.weight`).
        factors = torch.tensor(rope_scaling["factors"], dtype=torch.float32)
        return inv_freq / factors
    raise ValueError(f"rope scaling {rope_type!r} is not supported")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: slow frequencies divided by `factor`, fast ones kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    original_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    max_positions: int,
    rotary_dim: int,
    theta: float,
    rope_scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The RoPE table for positions 0 .. max_positions-1.

    Returns:
        [max_positions, rotary_dim] float32: cos half, then sin half.
    """
    inv_freq = inverse_frequencies(rotary_dim, theta, rope_scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    angles = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim // 2], radians
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


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
