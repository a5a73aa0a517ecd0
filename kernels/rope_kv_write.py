"""Fused RoPE + KV-cache write: rotate q and k, and store k and v into their cache slots, in one launch.

    rope_and_cache_write(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], positions [T],
                         cos_sin_cache [max_pos, R], k_cache, v_cache [num_blocks, block_size, Hkv, D],
                         slot_mapping [T]) -> (q, k) rotated in place

RoPE is rotate-half (NeoX / HF Llama) over the first R = rotary_dim dimensions: with
x1 = x[:R/2], x2 = x[R/2:R], the result is (x1 cos - x2 sin, x2 cos + x1 sin, x[R:]). The math is
float32; results are rounded once to the tensors' dtype. Token t's rotated k and its v go to slot
slot_mapping[t] (block slot // block_size, offset slot % block_size); slot -1 skips the write.
An fp8 (e4m3) cache stores k / k_scale[h] and v / v_scale[h], saturated to +-448.

One program handles one token: all its query and KV heads. Each element is loaded once, and the
two halves are paired in registers, so rotating in place needs no barrier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import (
    FLOAT_DTYPES,
    HALF_DTYPES,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    next_power_of_2,
    require,
)
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.reference import rope_and_cache_write_reference
from sits.kernels.rope_tables import build_cos_sin_cache

__all__ = ["build_cos_sin_cache", "rope_and_cache_write", "rope_and_cache_write_reference", "rope_pair"]

FP8_E4M3_MAX = 448.0
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def rope_pair(x1, x2, cos, sin):
    """The rotate-half pair (x1 cos - x2 sin, x2 cos + x1 sin) of float32 tensors, each an explicit FMA over
    the other product rounded: the compiler may not choose which product stays unrounded, so every kernel
    that rotates (this one, the decode attention's fused RoPE) gets the same bits."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_head,
    num_heads,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HALF: tl.constexpr,
):
    """Rotates the first 2*HALF dims of `num_heads` heads; returns both rotated halves (float32)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    ptrs = base_ptr + heads * stride_head + dims
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    rotated1, rotated2 = rope_pair(x1, x2, cos, sin)
    return rotated1, rotated2, ptrs, mask


@triton.jit
def store_cache(cache_ptr, values, scale, mask, FP8_CACHE: tl.constexpr):
    """Stores values (float32) into cache slots; an fp8 cache divides by the head's scale first."""
    if FP8_CACHE:
        values = tl.clamp(values / scale, -448.0, 448.0)
    tl.store(cache_ptr, values.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cache_write_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos_sin,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    num_q_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8_CACHE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    half_dims = tl.arange(0, BLOCK_HALF)[None, :]
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_row = cos_sin_ptr + position * stride_cos_sin
    cos = tl.load(cos_row + half_dims, mask=half_dims < ROTARY_DIM // 2, other=1.0)
    sin = tl.load(cos_row + ROTARY_DIM // 2 + half_dims, mask=half_dims < ROTARY_DIM // 2, other=0.0)

    q1, q2, q_ptrs, q_mask = _rotate_heads(
        q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, BLOCK_HQ, BLOCK_HALF, ROTARY_DIM // 2
    )
    tl.store(q_ptrs, q1.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_ptrs + ROTARY_DIM // 2, q2.to(q_ptr.dtype.element_ty), mask=q_mask)
    k1, k2, k_ptrs, k_mask = _rotate_heads(
        k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, BLOCK_HKV, BLOCK_HALF, ROTARY_DIM // 2
    )
    tl.store(k_ptrs, k1.to(k_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_ptrs + ROTARY_DIM // 2, k2.to(k_ptr.dtype.element_ty), mask=k_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        heads = tl.arange(0, BLOCK_HKV)[:, None]
        k_scale = 1.0
        v_scale = 1.0
        if FP8_CACHE:
            k_scale = tl.load(k_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
            v_scale = tl.load(v_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + heads * stride_kc_head
        store_cache(k_dst + half_dims, k1, k_scale, k_mask, FP8_CACHE)
        store_cache(k_dst + ROTARY_DIM // 2 + half_dims, k2, k_scale, k_mask, FP8_CACHE)
        dims = tl.arange(0, BLOCK_D)[None, :]
        if ROTARY_DIM < HEAD_DIM:  # partial rotary: the tail of k is copied unrotated
            tail = (heads < num_kv_heads) & (dims >= ROTARY_DIM) & (dims < HEAD_DIM)
            k_tail = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=tail, other=0.0)
            store_cache(k_dst + dims, k_tail.to(tl.float32), k_scale, tail, FP8_CACHE)
        v_mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=v_mask, other=0.0)
        v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads * stride_vc_head + dims
        store_cache(v_dst, v.to(tl.float32), v_scale, v_mask, FP8_CACHE)


def cache_dtypes(q_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The caches q's dtype may write: its own or fp8, and with float32 q (float32 activations beside a
    half-precision model) a half-precision cache too."""
    halves = HALF_DTYPES if q_dtype == torch.float32 else ()
    return (q_dtype, *halves, torch.float8_e4m3fn)


def _check_cache(cache: torch.Tensor, name: str, like: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    check_tensor(cache, name, ndim=4, dtypes=cache_dtypes(like.dtype), device=like.device)
    require(
        cache.shape[2] == num_kv_heads and cache.shape[3] == head_dim,
        f"{name} must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], got {tuple(cache.shape)}",
    )
    check_inner_contiguous(cache, name)


def _check_scale(scale: torch.Tensor | None, name: str, cache: torch.Tensor, num_kv_heads: int) -> None:
    if cache.dtype != torch.float8_e4m3fn:
        require(scale is None, f"{name} is only used with an fp8 cache")
        return
    require(scale is not None, f"an fp8 cache needs {name} [num_kv_heads] float32")
    check_tensor(scale, name, ndim=1, dtypes=(torch.float32,), device=cache.device)
    check_shape(scale, name, (num_kv_heads,))
    require(scale.is_contiguous(), f"{name} must be contiguous")


def rope_and_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place and writes rotated k and v into the paged cache.

    Args:
        q: [T, Hq, D] float16 / bfloat16 / float32, last dimension contiguous.
        k, v: [T, Hkv, D] in q's dtype.
        positions: [T] int32 / int64 absolute positions (< cos_sin_cache.shape[0]).
        cos_sin_cache: [max_positions, R] float32 from `build_cos_sin_cache`, R even and <= D.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] in q's dtype, or float8_e4m3fn; with float32 q also
            float16 / bfloat16 (k and v rounded to it as they are stored).
        slot_mapping: [T] int32 / int64 cache slots; -1 skips the token's write.
        k_scale, v_scale: [Hkv] float32 dequantization scales, required for an fp8 cache.
    Returns:
        (q, k), the same tensors, rotated.
    """
    check_tensor(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_q_heads, head_dim = q.shape
    check_tensor(k, "k", ndim=3, dtypes=(q.dtype,), device=q.device)
    num_kv_heads = k.shape[1]
    check_shape(k, "k", (num_tokens, num_kv_heads, head_dim))
    check_tensor(v, "v", ndim=3, dtypes=(q.dtype,), device=q.device)
    check_shape(v, "v", k.shape)
    for tensor, name in ((q, "q"), (k, "k"), (v, "v")):
        check_inner_contiguous(tensor, name)
    check_tensor(positions, "positions", ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    check_shape(positions, "positions", (num_tokens,))
    check_tensor(cos_sin_cache, "cos_sin_cache", ndim=2, dtypes=(torch.float32,), device=q.device)
    rotary_dim = cos_sin_cache.shape[1]
    require(
        rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim,
        f"cos_sin_cache's rotary_dim must be even and at most head_dim {head_dim}, got {rotary_dim}",
    )
    check_inner_contiguous(cos_sin_cache, "cos_sin_cache")
    _check_cache(k_cache, "k_cache", q, num_kv_heads, head_dim)
    _check_cache(v_cache, "v_cache", q, num_kv_heads, head_dim)
    require(k_cache.shape == v_cache.shape, "k_cache and v_cache must have the same shape")
    require(k_cache.dtype == v_cache.dtype, "k_cache and v_cache must have the same dtype")
    _check_scale(k_scale, "k_scale", k_cache, num_kv_heads)
    _check_scale(v_scale, "v_scale", v_cache, num_kv_heads)
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    check_shape(slot_mapping, "slot_mapping", (num_tokens,))
    if num_tokens == 0:
        return q, k
    fp8_cache = k_cache.dtype == torch.float8_e4m3fn
    _rope_cache_write_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        k_scale if fp8_cache else cos_sin_cache, v_scale if fp8_cache else cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_q_heads, num_kv_heads,
        HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
        BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HKV=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(rotary_dim // 2), BLOCK_D=next_power_of_2(head_dim),
        PAGE_SIZE=k_cache.shape[1], FP8_CACHE=fp8_cache,
        num_warps=4, **pdl_launch_options(q.device),
    )  # fmt: skip
    return q, k
