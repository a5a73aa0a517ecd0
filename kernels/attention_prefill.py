"""Prefill attention: causal flash attention over a flat variable-length batch, with GQA.

Two entries share one kernel:

    paged_prefill_attention(q [T, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D],
                            cu_seqlens_q [B+1], seq_lens [B], block_tables [B, max_blocks], scale,
                            max_query_len) -> out [T, Hq, D]
        The new tokens of sequence i are q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]; its whole context
        (cached prefix + new tokens, already written) is seq_lens[i] tokens in the paged cache. New
        token j sits at position seq_lens[i] - q_len_i + j and attends to positions <= its own
        (chunked prefill and prefix-cache hits are the same case).

    varlen_prefill_attention(q [Tq, Hq, D], k, v [Tk, Hkv, D], cu_seqlens_q, cu_seqlens_k, scale,
                             causal=True) -> out [Tq, Hq, D]
        Contiguous keys; causal masks align bottom-right (as FlashAttention) when q_len < k_len.

Hq must be a multiple of Hkv; head_dim a power of two from 16 to 256; q, k, v float16 or
bfloat16. The paged cache may also be float8_e4m3fn with per-KV-head scales (k_scale, v_scale);
its dots then run in float16 by default (fp8_via_float16, the FP8_F16 constexpr: q converted once
and clamped to +-65504, e4m3 -> f16 is one native instruction per pair where e4m3 -> bf16 takes
five), or with the tiles upcast to q's dtype. Softmax is online (base 2, the scale folded into one
multiply-add), accumulation float32.

Each program owns one (sequence, query head, BLOCK_M query rows) tile. Key tiles wholly below the
tile's first query position run without masks; only the diagonal tiles pay for the causal mask.
Programs are ordered heaviest query tile first, and neighbouring programs are neighbouring heads,
so query heads that share a KV head read it from L2 together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.attention_checks import (
    FP8_CACHE_DTYPE,
    check_block_tables,
    check_fp8_scales,
    check_index,
    check_kv_heads,
    check_paged_caches,
    check_query,
    prepare_out,
)
from sits.kernels.launch_utils import (
    FLOAT_DTYPES,
    HALF_DTYPES,
    autotune,
    check_inner_contiguous,
    check_tensor,
    length_bucket,
    require,
)
from sits.kernels.paged_kv import paged_tile_blocks
from sits.kernels.reference import paged_prefill_attention_reference, varlen_attention_reference

__all__ = [
    "paged_prefill_attention",
    "prefill_len_bucket",
    "paged_prefill_attention_reference",
    "varlen_attention_reference",
    "varlen_prefill_attention",
]

LOG2_E = 1.4426950408889634


def _config(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


_GPU_TILES_BY_SCHEDULE = {  # (num_warps, num_stages): its (BLOCK_M, BLOCK_N) tiles
    (8, 3): ((128, 128), (128, 64)),
    (8, 2): ((128, 128), (64, 64)),
    (8, 4): ((128, 64),),
    # Paged tiles load their block ids first, which costs the pipeliner two stages: 5 stages give
    # the paged path the K/V buffering the contiguous one gets at 3.
    (8, 5): ((128, 64), (128, 128)),
    (4, 4): ((128, 32), (64, 32)),
    (4, 3): ((64, 64), (32, 64), (16, 64)),  # (16, 64) last: the fallback when pruning keeps none
}
_GPU_CONFIGS = [
    _config(block_m, block_n, warps, stages)
    for (warps, stages), tiles in _GPU_TILES_BY_SCHEDULE.items()
    for block_m, block_n in tiles
]
_INTERPRETER_CONFIG = _config(16, 32, 4, 1)  # block 16: several pages per key tile; block 64: one


def _prune_configs(configs, named_args, **kwargs):
    """Keep tiles that fit the head size in registers and do not dwarf the longest query."""
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    max_query = named_args["len_bucket"]
    kept = []
    for config in configs:
        block_m, block_n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        if head_dim >= 256 and (block_m > 64 or block_n > 64 or config.num_stages > 2):
            continue
        if block_m > max(16, max_query):
            continue
        if max_query >= 256 and block_m < 64:
            continue
        kept.append(config)
    return kept or configs[-1:]


@triton.jit
def _attend_key_tiles(
    acc, l_i, m_i, q, q_pos,
    k_base, v_base, block_table_row, kv_token_base,
    stride_k_block, stride_k_token, stride_v_block, stride_v_token,
    lo, hi, k_len, qk_scale,
    offs_n, offs_d,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Online softmax over key tiles [lo, hi); MASKED applies the length (and causal) masks."""
    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        in_range = n < k_len
        if PAGED:
            blocks, slots = paged_tile_blocks(block_table_row, start_n, k_len, PAGE_SIZE, BLOCK_N, MASKED)
            k_rows = blocks * stride_k_block + slots * stride_k_token
            v_rows = blocks * stride_v_block + slots * stride_v_token
        else:
            token = (kv_token_base + n).to(tl.int64)
            k_rows = token * stride_k_token
            v_rows = token * stride_v_token
        if MASKED:
            k_t = tl.load(k_base + k_rows[None, :] + offs_d[:, None], mask=in_range[None, :], other=0.0)
        else:
            k_t = tl.load(k_base + k_rows[None, :] + offs_d[:, None])
        qk = tl.dot(q, k_t.to(q.dtype))
        if MASKED:
            if CAUSAL:
                visible = (n[None, :] <= q_pos[:, None]) & in_range[None, :]
            else:
                visible = in_range[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_new
        if MASKED:
            # A row with no visible key yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(v_base + v_rows[:, None] + offs_d[None, :])
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)
        m_i = m_new
    return acc, l_i, m_i


def prefill_len_bucket(max_query_len: int) -> int:
    """The autotune bucket of a launch: the power of two >= its longest query chunk (capped at 8192)."""
    return length_bucket(max_query_len)


# `len_bucket` only keys the autotuner and its pruning, so it is a plain argument: one binary per
# config serves every bucket. The block-table row stride (the batch's widest table) and the
# addresses of the fp8 scales vary from step to step; they are not specialized either, so no
# step recompiles a kernel the start-up pre-tune already built.
@autotune(_GPU_CONFIGS, _INTERPRETER_CONFIG, ["HEAD_DIM", "PAGED", "PAGE_SIZE", "CAUSAL", "FP8_KV", "FP8_F16",
                                          "len_bucket"],
          _prune_configs)
@triton.jit(do_not_specialize=["stride_block_table", "len_bucket"],
            do_not_specialize_on_alignment=["k_scale_ptr", "v_scale_ptr"])
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    cu_seqlens_q_ptr, kv_lengths_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale,
    stride_q_token, stride_q_head,
    stride_k_block, stride_k_token, stride_k_head,
    stride_v_block, stride_v_token, stride_v_head,
    stride_o_token, stride_o_head,
    stride_block_table,
    num_q_heads, group_size, len_bucket,
    HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    FP8_KV: tl.constexpr, FP8_F16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0) % num_q_heads
    seq = tl.program_id(0) // num_q_heads
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest (last) query tiles first
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    if PAGED:
        kv_token_base = 0
        k_len = tl.load(kv_lengths_ptr + seq)
    else:
        kv_token_base = tl.load(kv_lengths_ptr + seq)
        k_len = tl.load(kv_lengths_ptr + seq + 1) - kv_token_base
    kv_head = head // group_size
    if FP8_KV:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + offs_m).to(tl.int64)
    row_valid = offs_m < q_len
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    if FP8_KV and FP8_F16:  # the tiles' `.to(q.dtype)` is then the native e4m3 -> f16 conversion
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    elif q.dtype == tl.float32 and not FP8_KV:  # float32 activations: the dots take q in the cache's dtype
        q = q.to(k_ptr.dtype.element_ty)
    q_pos = offs_m + (k_len - q_len)  # absolute positions, bottom-right aligned

    if CAUSAL:
        first_pos = m_block * BLOCK_M + k_len - q_len
        last_pos = tl.minimum(m_block * BLOCK_M + BLOCK_M, q_len) - 1 + k_len - q_len
        unmasked_hi = tl.maximum(tl.minimum(first_pos + 1, k_len), 0) // BLOCK_N * BLOCK_N
        masked_hi = tl.maximum(tl.minimum(last_pos + 1, k_len), 0)
    else:
        unmasked_hi = k_len // BLOCK_N * BLOCK_N
        masked_hi = k_len

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    k_base = k_ptr + kv_head * stride_k_head
    v_base = v_ptr + kv_head * stride_v_head
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, q_pos, k_base, v_base, block_table_row, kv_token_base,
        stride_k_block, stride_k_token, stride_v_block, stride_v_token,
        0, unmasked_hi, k_len, qk_scale, offs_n, offs_d,
        False, CAUSAL, PAGED, PAGE_SIZE, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _attend_key_tiles(
        acc, l_i, m_i, q, q_pos, k_base, v_base, block_table_row, kv_token_base,
        stride_k_block, stride_k_token, stride_v_block, stride_v_token,
        unmasked_hi, masked_hi, k_len, qk_scale, offs_n, offs_d,
        True, CAUSAL, PAGED, PAGE_SIZE, BLOCK_N,
    )  # fmt: skip
    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw no key (q_len > k_len) write zeros
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_token + head * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def _launch(
    q, k, v, out, cu_seqlens_q, kv_lengths, block_tables, scale, max_query_len, paged, causal, group,
    k_scale=None, v_scale=None, fp8_via_float16=True,
):  # fmt: skip
    num_seqs = cu_seqlens_q.shape[0] - 1
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if num_seqs == 0 or max_query_len == 0 or q.shape[0] == 0:
        return out
    k_block_stride = k.stride(0) if paged else 0
    v_block_stride = v.stride(0) if paged else 0
    k_token_stride = k.stride(1) if paged else k.stride(0)
    v_token_stride = v.stride(1) if paged else v.stride(0)
    k_head_stride = k.stride(2) if paged else k.stride(1)
    v_head_stride = v.stride(2) if paged else v.stride(1)

    fp8 = k.dtype == torch.float8_e4m3fn

    def grid(meta):
        return (num_seqs * num_q_heads, triton.cdiv(max_query_len, meta["BLOCK_M"]))

    _prefill_attention_kernel[grid](
        q, k, v, out,
        cu_seqlens_q, kv_lengths, block_tables,
        k_scale if fp8 else kv_lengths, v_scale if fp8 else kv_lengths,
        float(scale) * LOG2_E,
        q.stride(0), q.stride(1),
        k_block_stride, k_token_stride, k_head_stride,
        v_block_stride, v_token_stride, v_head_stride,
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        num_q_heads, group, prefill_len_bucket(max_query_len),
        HEAD_DIM=head_dim, PAGED=paged, PAGE_SIZE=k.shape[1] if paged else 1, CAUSAL=causal, FP8_KV=fp8,
        FP8_F16=fp8 and bool(fp8_via_float16),
    )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fp8_via_float16: bool = True,
) -> torch.Tensor:
    """Causal attention of a flat batch of new tokens over their whole paged context.

    Args:
        q: [T, Hq, D] float16 / bfloat16, new tokens of B sequences back to back; or float32 (float32
            activations beside a half-precision cache: q is rounded to the cache's dtype for the dots).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] in q's dtype (a half-precision dtype for float32 q)
            or float8_e4m3fn, holding every context token (the new ones included).
        cu_seqlens_q: [B + 1] int32, cumulative new-token counts (cu_seqlens_q[0] = 0).
        seq_lens: [B] int32, context length of each sequence after this step (>= its q_len).
        block_tables: [B, max_blocks] int32 physical block ids (padding entries are never read).
        scale: softmax scale, usually D ** -0.5.
        max_query_len: the largest q_len in the batch (sets the grid; no device sync needed).
        out: optional [T, Hq, D] output buffer in q's dtype or float32 (written unrounded).
        k_scale, v_scale: [Hkv] float32 dequantization scales, for a float8_e4m3fn cache only.
        fp8_via_float16: with an fp8 cache, run the dots in float16 (native e4m3 -> f16
            conversion; q clamped to +-65504) instead of upcasting the tiles to q's dtype.
    Returns:
        out [T, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = check_query(q, FLOAT_DTYPES)
    float32_q = q.dtype == torch.float32
    check_paged_caches(q, k_cache, v_cache, (*HALF_DTYPES, FP8_CACHE_DTYPE) if float32_q else None)
    check_fp8_scales(k_cache, k_scale, v_scale)
    check_index(cu_seqlens_q, "cu_seqlens_q", None, q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    require(num_seqs >= 0, "cu_seqlens_q needs at least one entry")
    check_index(seq_lens, "seq_lens", num_seqs, q.device)
    check_block_tables(block_tables, num_seqs, q.device)
    require(int(max_query_len) >= 0, f"max_query_len must be >= 0, got {max_query_len}")
    out = prepare_out(out, q, (q.dtype, torch.float32))
    group = num_q_heads // k_cache.shape[2]
    return _launch(
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale, int(max_query_len), True, True, group,
        k_scale, v_scale, fp8_via_float16,
    )  # fmt: skip


def varlen_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool = True,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a flat variable-length batch with contiguous keys.

    Args:
        q: [Tq, Hq, D] float16 / bfloat16.
        k, v: [Tk, Hkv, D] in q's dtype.
        cu_seqlens_q, cu_seqlens_k: [B + 1] int32 cumulative lengths.
        scale: softmax scale.
        causal: mask keys after each query, aligned bottom-right when q_len < k_len; rows with no
            visible key (q_len > k_len) return zeros.
        max_query_len: the largest q_len; read from cu_seqlens_q (one device sync) when omitted.
        out: optional [Tq, Hq, D] output buffer.
    Returns:
        out [Tq, Hq, D].
    """
    num_tokens, num_q_heads, head_dim = check_query(q)
    for tensor, name in ((k, "k"), (v, "v")):
        check_tensor(tensor, name, ndim=3, dtypes=(q.dtype,), device=q.device)
        check_inner_contiguous(tensor, name)
    require(k.shape == v.shape, f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    require(k.shape[2] == head_dim, f"k's head_dim {k.shape[2]} differs from q's {head_dim}")
    check_kv_heads(num_q_heads, k.shape[1])
    check_index(cu_seqlens_q, "cu_seqlens_q", None, q.device)
    check_index(cu_seqlens_k, "cu_seqlens_k", cu_seqlens_q.shape[0], q.device)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.shape[0] > 1 else 0
    out = prepare_out(out, q)
    group = num_q_heads // k.shape[1]
    return _launch(q, k, v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_q, scale, int(max_query_len), False, causal, group)
