"""The decode tokens' RoPE and KV-cache write, fused into the decode split kernel (sits.kernels.attention_decode).

    DecodeRope(k, v, positions, cos_sin_cache, slot_mapping): what `paged_decode_attention(rope=...)` is given
    rope_rows / load_rows / write_new_kv: the kernel's side of it

Instead of rope_and_cache_write's launch before the attention, each split program rotates its query heads and
the new k as it loads them, and the program holding position seq_len - 1 stores the new k and v into their slot
exactly as rope_and_cache_write does (sharing its `rope_pair` and `store_cache`), so the fused launch computes
the same bits as the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import check_inner_contiguous, check_shape, check_tensor, require
from sits.kernels.rope_kv_write import rope_pair, store_cache

__all__ = ["DecodeRope", "load_rows", "rope_rows", "write_new_kv"]


@dataclass(frozen=True)
class DecodeRope:
    """The decode tokens' RoPE and K/V-cache write, done inside the split kernel (`paged_decode_attention(
    rope=...)`) instead of by `rope_and_cache_write` in a launch of its own before it.

    q is then passed unrotated. Each program rotates its query heads as it loads them (rounded to q's
    dtype, as rope_and_cache_write stores them), and the new k; the program holding position seq_len - 1
    of each (sequence, KV head) stores k and v into slot_mapping's slot exactly as
    rope_and_cache_write does, and reads them back from the cache after a barrier, so the output and
    the cache come out bit for bit those of the two launches at the same schedule. Neither q nor k is
    written back rotated.

    Attributes:
        k, v: [B, Hkv, D] the new tokens' key (not rotated) and value, in q's dtype, last dimension contiguous
            (views into the fused qkv output are fine).
        positions: [B] int32 / int64 positions (< cos_sin_cache.shape[0]); seq_lens - 1 for a decode.
        cos_sin_cache: [max_positions, R] float32, cos in the first R / 2 columns, sin in the next; R even, <= D.
        slot_mapping: [B] int32 / int64 cache slot of each new token: that of position seq_lens - 1 in the
            sequence's block table; -1 (padding) writes nothing.
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def check(self, q: torch.Tensor, num_kv_heads: int) -> None:
        """Shapes, dtypes and strides against q [B, Hq, D] and the cache's KV heads."""
        num_seqs, _, head_dim = q.shape
        for tensor, name in ((self.k, "k"), (self.v, "v")):
            check_tensor(tensor, name, ndim=3, dtypes=(q.dtype,), device=q.device)
            check_shape(tensor, name, (num_seqs, num_kv_heads, head_dim))
            check_inner_contiguous(tensor, name)
        for tensor, name in ((self.positions, "positions"), (self.slot_mapping, "slot_mapping")):
            check_tensor(tensor, name, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
            check_shape(tensor, name, (num_seqs,))
        check_tensor(self.cos_sin_cache, "cos_sin_cache", ndim=2, dtypes=(torch.float32,), device=q.device)
        check_inner_contiguous(self.cos_sin_cache, "cos_sin_cache")
        rotary_dim = self.cos_sin_cache.shape[1]
        require(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim,
                f"cos_sin_cache's rotary_dim must be even and at most head_dim {head_dim}, got {rotary_dim}")

    def args(self) -> tuple:
        """The split kernel's k_new .. slot pointers and their strides."""
        return (self.k, self.v, self.positions, self.cos_sin_cache, self.slot_mapping, self.k.stride(0),
                self.k.stride(1), self.v.stride(0), self.v.stride(1), self.cos_sin_cache.stride(0))


@triton.jit
def rope_rows(row_ptrs, row_valid, cos_sin_row, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr):
    """Rows [R, HEAD_DIM] at row_ptrs [R] (contiguous elements) rotated by RoPE, float32; invalid rows 0.

    cos_sin_row points at the position's row of the cos / sin table (cos in its first ROTARY_DIM / 2
    columns, sin in the next). Dimension d < ROTARY_DIM / 2 pairs with d + ROTARY_DIM / 2; each half
    gets its own products (its own cos / sin loads), one use each, as in `_rope_cache_write_kernel`;
    dimensions from ROTARY_DIM on pass through unrotated."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    dims = tl.arange(0, HEAD_DIM)[None, :]
    first = dims < HALF
    second = (dims >= HALF) & (dims < ROTARY_DIM)
    x = tl.load(row_ptrs[:, None] + dims, mask=row_valid[:, None], other=0.0).to(tl.float32)
    partner = tl.load(row_ptrs[:, None] + tl.where(first, dims + HALF, dims - HALF),
                      mask=row_valid[:, None] & (dims < ROTARY_DIM), other=0.0).to(tl.float32)
    cos_first = tl.load(cos_sin_row + dims, mask=first, other=1.0)
    sin_first = tl.load(cos_sin_row + HALF + dims, mask=first, other=0.0)
    cos_second = tl.load(cos_sin_row + dims - HALF, mask=second, other=1.0)
    sin_second = tl.load(cos_sin_row + dims, mask=second, other=0.0)
    rotated_first, _ = rope_pair(x, partner, cos_first, sin_first)
    _, rotated_second = rope_pair(partner, x, cos_second, sin_second)
    return tl.where(first, rotated_first, tl.where(second, rotated_second, x))


@triton.jit
def load_rows(row_ptrs, row_valid, HEAD_DIM: tl.constexpr):
    """Rows [R, HEAD_DIM] at row_ptrs [R] (contiguous elements) as stored; invalid rows 0."""
    dims = tl.arange(0, HEAD_DIM)[None, :]
    return tl.load(row_ptrs[:, None] + dims, mask=row_valid[:, None], other=0.0)


@triton.jit
def write_new_kv(k_new, v_new, slot, kv_head, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                  stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
                  PAGE_SIZE: tl.constexpr, FP8_KV: tl.constexpr):  # fmt: skip
    """The sequence's new token, one KV head: k_new (rotated, float32) and v_new (as loaded) [1, HEAD_DIM]
    stored into cache slot `slot` (nothing for slot -1) as `_rope_cache_write_kernel` stores them
    (`store_cache`: from float32, an fp8 cache divided by the head's scale and saturated), then a barrier,
    so this program's own tile loads after it read them back (global stores before bar.sync are visible
    to the whole CTA after it)."""
    if slot >= 0:
        row = tl.arange(0, 1)
        row_valid = row < 1
        dims = tl.arange(0, k_new.shape[1])[None, :]
        v = v_new.to(tl.float32)
        k_scale = 1.0
        v_scale = 1.0
        if FP8_KV:
            k_scale = tl.load(k_scale_ptr + kv_head)
            v_scale = tl.load(v_scale_ptr + kv_head)
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        k_dst = k_cache_ptr + block * stride_k_block + offset * stride_k_slot + kv_head * stride_k_head
        v_dst = v_cache_ptr + block * stride_v_block + offset * stride_v_slot + kv_head * stride_v_head
        store_cache(k_dst + row[:, None] + dims, k_new, k_scale, row_valid[:, None], FP8_KV)
        store_cache(v_dst + row[:, None] + dims, v, v_scale, row_valid[:, None], FP8_KV)
        tl.debug_barrier()
