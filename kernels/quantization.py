"""Offline weight quantization helpers (plain PyTorch, run once when a model loads).

    quantize_weight_fp8_per_channel(w [N, K]) -> (w_fp8 [N, K] float8_e4m3fn, scale [N, 1] float32)
    quantize_weight_int8(w [N, K], group_size) -> (w_int8 [N, K] int8, scales [N, K // group_size] float32)

Both are symmetric: w ~= w_q * scale, with the scale chosen so the largest magnitude of a channel
(fp8) or of a group of `group_size` consecutive input features (int8) maps to the format's maximum.
Weights keep nn.Linear's [out_features, in_features] layout.
"""

from __future__ import annotations

import torch

from sits.kernels.reference import FP8_E4M3_MAX

__all__ = ["FP8_E4M3_MAX", "INT8_MAX", "quantize_weight_fp8_per_channel", "quantize_weight_int8"]

INT8_MAX = 127.0
_TINY = 1e-12  # all-zero rows and groups get this amax, so scales are never zero


def _check_weight(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"w must be a 2-D [out_features, in_features] tensor, got {getattr(w, 'shape', type(w))}")
    if not w.is_floating_point() or w.dtype == torch.float8_e4m3fn:
        raise ValueError(f"w must be float16, bfloat16 or float32, got {w.dtype}")


def quantize_weight_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3 quantization of a [N, K] weight; returns (w_fp8, scale [N, 1] float32)."""
    _check_weight(w)
    wf = w.float()
    scale = wf.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / FP8_E4M3_MAX
    w_fp8 = (wf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return w_fp8, scale


def quantize_weight_int8(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group symmetric int8 quantization along K; returns (w_int8 [N, K], scales [N, K // group_size])."""
    _check_weight(w)
    out_features, in_features = w.shape
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"in_features ({in_features}) must be a positive multiple of group_size ({group_size})")
    groups = w.float().reshape(out_features, in_features // group_size, group_size)
    scales = groups.abs().amax(dim=-1).clamp(min=_TINY) / INT8_MAX
    w_int8 = torch.round(groups / scales[..., None]).clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8)
    return w_int8.reshape(out_features, in_features), scales
