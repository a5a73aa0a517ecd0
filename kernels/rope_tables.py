"""RoPE tables: inverse frequencies (plain, linear or llama3-scaled) and the cos/sin cache.

Pure PyTorch, so the model code can build its table on any device without Triton.

    build_cos_sin_cache(rotary_dim, max_positions, theta, rope_scaling) -> [max_positions, rotary_dim]

Layout (rotate-half / NeoX, as HF Llama): cos in the first rotary_dim / 2 columns, sin in the rest.
The frequencies are computed in float32 exactly as HF transformers does, so a model using this table
matches `LlamaRotaryEmbedding` to the last bit of the angle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = ["build_cos_sin_cache", "rope_inverse_frequencies"]


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Mapping) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths / factor, short ones kept, smooth between."""
    try:
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        original_context = float(scaling["original_max_position_embeddings"])
    except KeyError as missing:
        raise ValueError(f"llama3 rope_scaling needs {missing.args[0]!r}") from None
    if high_freq_factor <= low_freq_factor:
        raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inverse_frequencies(
    rotary_dim: int, theta: float, rope_scaling: Mapping | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """[rotary_dim / 2] float32 inverse frequencies, optionally scaled.

    rope_scaling follows HF's config format: None or {"rope_type": "default"} for none,
    {"rope_type": "linear", "factor": f}, {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"} ("type" is accepted for "rope_type"), or
    {"rope_type": "freq_factors", "factors": [...]}: a divisor per frequency, the form GGUF files
    store Llama 3.1's scaling in (`rope_freqs.weight`).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if theta <= 0:
        raise ValueError(f"theta must be positive, got {theta}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope_scaling)
    if rope_type == "freq_factors":
        factors = torch.as_tensor(rope_scaling["factors"], dtype=torch.float32, device=inv_freq.device)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"freq_factors needs {inv_freq.numel()} factors, got {factors.numel()}")
        return inv_freq / factors
    raise ValueError(f"unsupported rope_type {rope_type!r}; expected default, linear, llama3 or freq_factors")


def build_cos_sin_cache(
    rotary_dim: int,
    max_positions: int,
    theta: float = 10000.0,
    rope_scaling: Mapping | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_positions, rotary_dim] float32: cos(pos * f) in the first half, sin(pos * f) in the second."""
    if max_positions <= 0:
        raise ValueError(f"max_positions must be positive, got {max_positions}")
    target = torch.device(device) if device is not None else torch.get_default_device()
    if target.type == "meta":
        # A model built on the meta device needs the table's shape only (to_empty rebuilds it). Computed there,
        # the ops run through torch's Python references, whose first use imports torch._dynamo and sympy:
        # over a CPU-second per process. The frequencies (rotary_dim / 2 values) still validate the arguments.
        half = rope_inverse_frequencies(rotary_dim, theta, rope_scaling, "cpu").numel()
        return torch.empty(max_positions, 2 * half, dtype=torch.float32, device=target)
    inv_freq = rope_inverse_frequencies(rotary_dim, theta, rope_scaling, device)
    positions = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).float()
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).contiguous()
