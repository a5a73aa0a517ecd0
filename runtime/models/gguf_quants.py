"""Dequantizing GGUF tensors (ggml block formats) to plain torch tensors, vectorised over blocks.

Supported: F32, F16, BF16 (returned as they are) and Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (returned as
float32). Each ggml block type stores a fixed number of weights in a fixed number of bytes, with
its scale(s) as float16; layouts as documented in ggml's `ggml-common.h`:

    Q8_0  32 weights, 34 bytes:  d:f16, qs:int8[32]                          w = d·q
    Q4_0  32 weights, 18 bytes:  d:f16, qs:u8[16] (low nibbles 0..15, high 16..31)   w = d·(q − 8)
    Q4_1  32 weights, 20 bytes:  d:f16, m:f16, qs:u8[16]                     w = d·q + m
    Q4_K 256 weights, 144 bytes: d:f16, dmin:f16, scales:u8[12] (8 × 6-bit scale and min), qs:u8[128]
                                 w = d·scale_j·q − dmin·min_j over 8 sub-blocks of 32
    Q6_K 256 weights, 210 bytes: ql:u8[128] (low 4 bits), qh:u8[64] (high 2 bits), scales:int8[16], d:f16
                                 w = d·scale_j·(q − 32) over 16 sub-blocks of 16
"""

from __future__ import annotations

import enum

import numpy as np
import torch


class GGMLType(enum.IntEnum):
    """ggml tensor type ids (as stored in the file) of the formats we read."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14
    BF16 = 30


# (weights per block, bytes per block)
BLOCK_SHAPES = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q6_K: (256, 210),
}


class UnsupportedQuantizationError(ValueError):
    """A tensor is stored in a ggml type this loader does not dequantize."""


def dequantize(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one tensor.

    Args:
        raw: the tensor's bytes (any dtype / shape; only the bytes are used).
        ggml_type: the ggml type id.
        shape: the logical shape, row-major (GGUF lists it reversed: ne0 = columns first).
    Returns:
        a tensor of `shape`: float32 for quantized types, the stored dtype for F32/F16/BF16.
    Raises:
        UnsupportedQuantizationError: an unsupported type, or a byte count that does not match.
    """
    try:
        kind = GGMLType(ggml_type)
    except ValueError:
        raise UnsupportedQuantizationError(
            f"ggml type {ggml_type} is not supported (supported: {', '.join(t.name for t in GGMLType)})"
        ) from None
    data = _as_bytes(raw)
    per_block, block_bytes = BLOCK_SHAPES[kind]
    numel = int(np.prod(shape)) if shape else 1
    if numel % per_block or data.numel() != numel // per_block * block_bytes:
        raise UnsupportedQuantizationError(
            f"{kind.name} tensor of shape {tuple(shape)} needs {numel // per_block * block_bytes} bytes "
            f"in blocks of {per_block}, got {data.numel()}"
        )
    if kind in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        dtype = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}[kind]
        return data.view(dtype).reshape(shape)
    blocks = data.reshape(-1, block_bytes)
    decode = {
        GGMLType.Q8_0: _q8_0,
        GGMLType.Q4_0: _q4_0,
        GGMLType.Q4_1: _q4_1,
        GGMLType.Q4_K: _q4_k,
        GGMLType.Q6_K: _q6_k,
    }[kind]
    return decode(blocks).reshape(shape)


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().view(torch.uint8).reshape(-1)
    array = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if not array.flags.writeable:  # memory-mapped file: torch wants a writable buffer
        array = array.copy()
    return torch.from_numpy(array)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of each block, as float32 [num_blocks, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return d * q


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes → [n, 32] values: low nibbles are weights 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).to(torch.int16) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:]).float()
    return d * q + m


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes → 8 six-bit scales and 8 six-bit mins, [n, 8] each (ggml's get_scale_min_k4)."""
    p = packed.to(torch.int32)
    low_scales, low_mins = p[:, 0:4] & 63, p[:, 4:8] & 63
    high_scales = (p[:, 8:12] & 0x0F) | ((p[:, 0:4] >> 6) << 4)
    high_mins = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return torch.cat([low_scales, high_scales], dim=-1), torch.cat([low_mins, high_mins], dim=-1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    # 4 chunks of 32 bytes; in each, low nibbles are sub-block 2c and high nibbles sub-block 2c + 1.
    qs = blocks[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    scale = (d * scales.float())[:, :, None]
    offset = (dmin * mins.float())[:, :, None]
    return (scale * q - offset).reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].to(torch.int32)
    qh = blocks[:, 128:192].to(torch.int32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    halves = []
    for h in range(2):  # each half of 128 weights: 64 bytes of ql, 32 bytes of qh
        low = ql[:, 64 * h:64 * h + 64]
        high = qh[:, 32 * h:32 * h + 32]
        halves += [
            (low[:, :32] & 0x0F) | ((high & 3) << 4),
            (low[:, 32:] & 0x0F) | (((high >> 2) & 3) << 4),
            (low[:, :32] >> 4) | (((high >> 4) & 3) << 4),
            (low[:, 32:] >> 4) | (((high >> 6) & 3) << 4),
        ]
    q = (torch.cat(halves, dim=-1) - 32).float().reshape(n, 16, 16)
    return ((d * scales)[:, :, None] * q).reshape(n, 256)
