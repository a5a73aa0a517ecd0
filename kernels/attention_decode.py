"""Decode attention (flash-decoding): one query token per sequence over its paged KV cache.

    paged_decode_attention(q [B, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D],
                           block_tables [B, max_blocks], seq_lens [B], scale) -> out [B, Hq, D]

Each program takes one (sequence, KV head, context split): it loads that KV head's keys and values
once for all Hq / Hkv query heads that share it (the query heads are the rows of one tl.dot), runs
an online softmax over its split, and writes a normalized partial result with its log-sum-exp.
A second small kernel merges the splits. Splitting the context keeps every multiprocessor busy
when batch x KV heads alone would not; with one split the first kernel writes the output directly.
The host picks how many splits to launch from the shapes (`plan_decode_splits`); each sequence's split
length comes from its own seq_len inside the kernels (`split_tokens`), so a short context under a wide
block table (a CUDA graph's spans max_model_len) is still spread over the splits, not held by the first.
Given split_counters (a persistent zeroed int32 buffer, one counter per sequence and KV head), the
last split of each sequence and KV head to finish merges instead, inside the split kernel (one
launch, the same bits; see sits.kernels.last_arrival for the memory ordering); FUSED_MERGE_DEFAULT says whether
callers that own counters (the Triton attention back end) pass them.

Given rope (`DecodeRope`), the kernel also does what rope_and_cache_write would have done for these
tokens just before it: each program rotates its query heads and the new k as it loads them (all of its
first loads go out together), and the program holding position seq_len - 1 of each (sequence, KV head)
stores k and v into their cache slot and reads them back in its own tiles after a barrier; the output and
the cache are those of the two launches, bit for bit, at the same schedule (a fused launch runs the one
tuned for the unfused launch).

q may be float32 (float32 activations) over a half-precision or fp8 cache: q and the softmax weights P
enter the dots as two terms of the dots' dtype each (hi = the value rounded, lo = what hi leaves, rounded),
with float32 sums, so the result keeps about twice the dots' mantissa; out may be float32 (unrounded).
(The fp8 q8x2 variants keep their two e4m3 terms of q; a float32 q defaults to DEFAULT_FP8_VARIANT.)

Rows with seq_len 0 (CUDA-graph padding) read nothing and return zeros. The grid depends only on
shapes (the block-table width bounds the context), so a launch never syncs with the device and can
be captured in a CUDA graph (after the first call, which autotunes).

An fp8 (e4m3) cache is read with per-KV-head float32 scales k_scale / v_scale [Hkv]; the scales
fold into the softmax scale and the output. By default (fp8_via_float16, the FP8_F16 constexpr)
the fp8 tiles, P and q run the dots in float16: Hopper converts e4m3 pairs to f16 pairs in one
instruction (cvt.rn.f16x2.e4m3x2), while Triton's e4m3 -> bf16 adds f16 -> f32 -> bf16 per element
(five instructions per pair), which at one byte per element makes the loop ALU-bound. q is
converted once per program (clamped to float16's +-65504); accumulation stays float32. The other
setting upcasts the tiles to q's dtype (the first implementation), kept for comparison.

The fp8 inner loop has variants (FP8_DECODE_VARIANTS, fp8_variant=): DEFAULT_FP8_VARIANT ("swap_g_f")
puts the tokens on the dots' M side, gives the dots exactly the GQA group's query heads and runs the
tiles inside the context without masks; launches of one split with at most two programs per
multiprocessor run SMALL_BATCH_FP8_VARIANT instead (choose_fp8_variant; SITS_FP8_DECODE_VARIANT forces one).
A bf16 / fp16 cache may run those of the loops that take the tiles as stored (HALF_DECODE_VARIANTS, half_variant=
or SITS_DECODE_VARIANT); it runs DEFAULT_HALF_VARIANT ("base", every tile masked, q padded to 16 rows), which
no other loop beat on the H200 (2026-12-05).

At batch 1 (Llama-3-8B, 2,048 tokens: 64 programs) the kernel is bound by each program's own chain of work, not by
HBM: on the H200 (2026-12-05) it took 10.4 µs with the split kernel and its merge with K / V cold and 9.1 µs with them
already in L2, and Nsight Compute put a fifth of its warps' stalls on the wait for the K / V tiles
(benchmarks/RESULTS.md). A prefetch of K / V into L2 ahead of it therefore has little to win (one was measured
and withdrawn).

Where the parts live: the split kernel and its launcher here; how contexts are cut into splits in
sits.kernels.decode_splits; the schedules, loop variants and their choice in sits.kernels.decode_schedules; one
tile's online-softmax step in sits.kernels.decode_tiles; the fused RoPE + KV write in sits.kernels.decode_rope; the
merges in sits.kernels.decode_merge.
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
    check_paged_caches,
    check_query,
    prepare_out,
)
from sits.kernels.decode_merge import fused_merge, merge_splits, store_group_rows
from sits.kernels.decode_rope import DecodeRope, load_rows, rope_rows, write_new_kv
from sits.kernels.decode_schedules import (
    DEFAULT_FP8_VARIANT,
    DEFAULT_HALF_VARIANT,
    FP8_DECODE_VARIANTS,
    GPU_CONFIGS,
    GROUP_ROWS,
    HALF_DECODE_VARIANTS,
    INTERPRETER_CONFIG,
    PACKED,
    SMALL_BATCH_FP8_VARIANT,
    choose_fp8_variant,
    choose_half_variant,
    prune_configs,
    schedule_meta,
    schedule_of,
    split_kernel_meta,
)
from sits.kernels.decode_splits import (
    SPLIT_GRANULE,
    SPLIT_TOKENS_ENV,
    DecodeSplitPlan,
    choose_num_splits,
    kernel_filled_splits,
    kernel_split_tokens,
    plan_decode_splits,
    split_count,
    split_granule,
    split_tokens,
)
from sits.kernels.decode_tiles import quantize_rows_e4m3, rows_tile, swap_tile
from sits.kernels.launch_utils import (
    HALF_DTYPES,
    autotune,
    check_tensor,
    is_interpreter,
    next_power_of_2,
    num_sms,
    require,
)
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.reference import paged_decode_attention_reference

__all__ = [
    "DEFAULT_FP8_VARIANT",
    "DEFAULT_HALF_VARIANT",
    "FP8_DECODE_VARIANTS",
    "HALF_DECODE_VARIANTS",
    "FUSED_MERGE_DEFAULT",
    "FUSED_ROPE_DEFAULT",
    "SMALL_BATCH_FP8_VARIANT",
    "DecodeRope",
    "DecodeSplitPlan",
    "choose_fp8_variant",
    "choose_half_variant",
    "choose_num_splits",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "plan_decode_splits",
    "split_count",
    "split_tokens",
]

LOG2_E = 1.4426950408889634
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension (sequences)
# Whether callers that own split counters (the Triton attention back end) pass them, so split launches
# merge inside the split kernel (one launch) instead of in decode_merge_kernel (two). Off until timed
# on an H200 (`bench_attention_decode.py --small-batch` prints both); switching it on is this line.
FUSED_MERGE_DEFAULT = False
# Whether the Triton attention back end runs the decode rows' RoPE + KV-cache write inside this kernel
# (`DecodeRope`) instead of as rope_and_cache_write's launch before it (SITS_DECODE_FUSED_ROPE=0 / 1 overrides).
# On: on the H200 (2026-12-03, Llama-3-8B shape) it takes a decode step from 4.592 to 4.537 ms at batch 1 and from
# 6.650 to 6.624 at batch 32, and tests/gpu/test_kernel_warmup.py finds nothing compiled after start-up with it on
# (benchmarks/RESULTS.md).
FUSED_ROPE_DEFAULT = True


# Arguments that change from step to step without changing the code are not specialized, so a
# step never recompiles what the start-up pre-tune built: the block-table row stride (the widest
# table of the batch), the partial buffers' strides (they follow the split count) and the
# addresses of per-sequence rows (a mixed step's decodes start after its prefills, also in the fused RoPE's
# positions and slots).
_VARYING_INTS = ["stride_block_table", "stride_po_seq", "stride_po_head", "stride_po_split", "stride_pl_seq",
                 "stride_pl_head", "min_split_tokens", "split_bucket"]
_VARYING_POINTERS = ["block_tables_ptr", "seq_lens_ptr", "k_scale_ptr", "v_scale_ptr", "split_counters_ptr",
                     "positions_ptr", "slot_ptr"]


@autotune(GPU_CONFIGS, INTERPRETER_CONFIG, ["HEAD_DIM", "PAGE_SIZE", "BLOCK_G", "FP8_KV", "FP8_F16", "VARIANT",
           "SINGLE_SPLIT", "FUSED_MERGE", "MERGE_BLOCK", "split_bucket"],
          prune_configs)
@triton.jit(do_not_specialize=_VARYING_INTS, do_not_specialize_on_alignment=_VARYING_POINTERS)
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, k_scale_ptr, v_scale_ptr, split_counters_ptr,
    qk_scale,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_o_seq, stride_o_head,
    stride_block_table,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    min_split_tokens, group_size, split_bucket,
    k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, slot_ptr,
    stride_kn_seq, stride_kn_head, stride_vn_seq, stride_vn_head, stride_cos_sin,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, FP8_KV: tl.constexpr, FP8_F16: tl.constexpr, VARIANT: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_BLOCK: tl.constexpr, MERGE_G: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False, ROTARY_DIM: tl.constexpr = 0, F32_TERMS: tl.constexpr = False,
):  # fmt: skip
    """One (KV head, sequence, split) program; see the module docstring and, for FUSED_MERGE,
    `fused_merge` (MERGE_BLOCK: the merge's BLOCK_S; MERGE_G: the GQA group as a power of two).
    USE_PDL: launched with programmatic dependent launch (sits.kernels.pdl). ROTARY_DIM > 0: the fused
    RoPE + KV write (`DecodeRope`; k_new / v_new / positions / cos_sin / slot and their strides are read
    only then). F32_TERMS: q is float32; q and P enter the dots as two terms (hi + lo) of their dtype."""
    pdl_wait(USE_PDL)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    # Every load of the prologue goes out before any loaded value is used (the cos / sin row after the position),
    # so their round trips overlap: the query rows, and under the fused RoPE the new k / v (all programs load
    # them; the writer stores them), above the early exit. Loaded after it, each waited for the one before
    # (docs/engine-process.md, "The split kernel's first loads overlap").
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    q_heads = kv_head * group_size + offs_g
    head_valid = offs_g < group_size
    q_rows = q_ptr + seq * stride_q_seq + q_heads * stride_q_head
    if ROTARY_DIM > 0:
        new_row = tl.arange(0, 1)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        v_new = load_rows(v_new_ptr + seq * stride_vn_seq + kv_head * stride_vn_head + new_row, new_row < 1,
                           HEAD_DIM)
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq).to(tl.int64) * stride_cos_sin
        k_new = rope_rows(k_new_ptr + seq * stride_kn_seq + kv_head * stride_kn_head + new_row, new_row < 1,
                           cos_sin_row, HEAD_DIM, ROTARY_DIM)
        # rounded to q's dtype, as rope_and_cache_write stores it
        q = rope_rows(q_rows, head_valid, cos_sin_row, HEAD_DIM, ROTARY_DIM).to(q_ptr.dtype.element_ty)
    else:
        q = load_rows(q_rows, head_valid, HEAD_DIM)
    tokens_per_split = kernel_split_tokens(seq_len, tl.num_programs(2), min_split_tokens)
    start = split * tokens_per_split
    if ROTARY_DIM > 0:
        # Exactly one program per (sequence, KV head) writes the new token, before any early return: the
        # split holding position seq_len - 1 (split 0 for a padding row; the last launched one past them).
        writer = tl.minimum(tl.maximum(seq_len - 1, 0) // tokens_per_split, tl.num_programs(2) - 1)
        if split == writer:
            write_new_kv(k_new, v_new, slot, kv_head, k_cache_ptr, v_cache_ptr,
                          k_scale_ptr, v_scale_ptr, stride_k_block, stride_k_slot, stride_k_head,
                          stride_v_block, stride_v_slot, stride_v_head,
                          PAGE_SIZE, FP8_KV)  # fmt: skip
    if not SINGLE_SPLIT and start >= seq_len:
        if FUSED_MERGE and split == 0:  # nothing arrives for a padding row (seq_len 0): split 0 writes zeros
            store_group_rows(out_ptr, seq, kv_head, group_size, stride_o_seq, stride_o_head,
                              tl.zeros([MERGE_G, HEAD_DIM], dtype=tl.float32), HEAD_DIM, MERGE_G)
        return  # an empty split: it never counts, and no merge reads it
    end = tl.minimum(start + tokens_per_split, seq_len)

    scale = qk_scale
    q_low = q  # F32_TERMS: what the dots' dtype leaves of a float32 q (rounded to that dtype)
    if FP8_KV:
        scale = scale * tl.load(k_scale_ptr + kv_head)
        if FP8_F16:  # every `.to(q.dtype)` below is then the native e4m3 -> f16 conversion
            q_wide = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
            q = q_wide.to(tl.float16)
            if F32_TERMS:
                q_low = (q_wide - q.to(tl.float32)).to(tl.float16)
    elif F32_TERMS:
        q_wide = q
        q = q_wide.to(k_cache_ptr.dtype.element_ty)
        q_low = (q_wide - q.to(tl.float32)).to(k_cache_ptr.dtype.element_ty)
    if VARIANT & 4:  # fp8 QK dots: q's per-row scale joins the softmax scale
        if F32_TERMS:
            q_hi, q_lo, q_row_scale = quantize_rows_e4m3(q_wide)
        else:
            q_hi, q_lo, q_row_scale = quantize_rows_e4m3(q.to(tl.float32))
        row_scale = q_row_scale * scale  # [BLOCK_G]
    block_table_row = block_tables_ptr + seq * stride_block_table
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    # With FULL_TILES the tiles wholly inside [start, end) run without masks, the last partial one after.
    full_end = start + (end - start) // BLOCK_N * BLOCK_N if VARIANT & 16 else start
    if VARIANT & 2:
        acc_t = tl.zeros([HEAD_DIM, BLOCK_G], dtype=tl.float32)  # out^T
        q_t = tl.trans(q)
        q_hi_t, q_lo_t, row_scale_q = q_t, q_t, scale
        if F32_TERMS:
            q_lo_t = tl.trans(q_low)
        if VARIANT & 4:
            q_hi_t, q_lo_t, row_scale_q = tl.trans(q_hi), tl.trans(q_lo), row_scale
        if VARIANT & 32:  # [D, 2G]: hi's G columns, then lo's
            q_hi_t = tl.trans(tl.reshape(tl.permute(tl.join(q_hi, q_lo), (2, 0, 1)), [2 * BLOCK_G, HEAD_DIM]))
        for masked in tl.static_range(2):  # the full tiles unmasked, then the rest masked
            for tile_start in range(full_end if masked else start, end if masked else full_end, BLOCK_N):
                acc_t, m_i, l_i = swap_tile(
                    acc_t, m_i, l_i, q_t, q_hi_t, q_lo_t, row_scale_q, tile_start, end, block_table_row, k_base,
                    v_base, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
                    HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_G, VARIANT & 4, VARIANT & 32, masked == 1, F32_TERMS,
                )  # fmt: skip
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        for masked in tl.static_range(2):  # the full tiles unmasked, then the rest masked
            for tile_start in range(full_end if masked else start, end if masked else full_end, BLOCK_N):
                acc, m_i, l_i = rows_tile(
                    acc, m_i, l_i, q, q_low, scale, tile_start, end, block_table_row, k_base, v_base,
                    stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
                    HEAD_DIM, PAGE_SIZE, BLOCK_N, VARIANT & 1, masked == 1, F32_TERMS,
                )  # fmt: skip

    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    safe_l = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0: no key, zeros out
    result = acc / safe_l[:, None]
    if SINGLE_SPLIT:
        dst = out_ptr + seq * stride_o_seq + q_heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(dst, result.to(out_ptr.dtype.element_ty), mask=head_valid[:, None])
    else:
        dst = (
            partial_out_ptr + seq * stride_po_seq + q_heads[:, None] * stride_po_head
            + split * stride_po_split + offs_d[None, :]
        )  # fmt: skip
        tl.store(dst, result, mask=head_valid[:, None])
        lse = m_i + tl.math.log2(safe_l)
        tl.store(partial_lse_ptr + seq * stride_pl_seq + q_heads * stride_pl_head + split, lse, mask=head_valid)
        if FUSED_MERGE:
            # seq_len loaded again and the split length recomputed: nothing of the prologue kept across the loop.
            seq_len = tl.load(seq_lens_ptr + seq)
            filled = kernel_filled_splits(seq_len, kernel_split_tokens(seq_len, tl.num_programs(2), min_split_tokens),
                                    tl.num_programs(2))
            fused_merge(partial_out_ptr, partial_lse_ptr, out_ptr, split_counters_ptr, seq, kv_head, filled,
                         group_size, stride_po_seq, stride_po_head, stride_po_split,
                         stride_pl_seq, stride_pl_head, stride_o_seq, stride_o_head,
                         HEAD_DIM, MERGE_BLOCK, MERGE_G)  # fmt: skip


# The decode query's dtypes: float32 (float32 activations) beside a half-precision or fp8 cache too.
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale):
    num_seqs = check_query(q, QUERY_DTYPES)[0]
    float32_q = q.dtype == torch.float32
    check_paged_caches(q, k_cache, v_cache, (*HALF_DTYPES, FP8_CACHE_DTYPE) if float32_q else None)
    check_block_tables(block_tables, num_seqs, q.device)
    check_index(seq_lens, "seq_lens", num_seqs, q.device)
    if out is not None:
        prepare_out(out, q, (q.dtype, torch.float32))
    check_fp8_scales(k_cache, k_scale, v_scale)


def _check_split_counters(split_counters: torch.Tensor, num_seqs: int, num_kv_heads: int,
                          device: torch.device) -> None:
    """A contiguous 1-D int32 buffer on q's device with a counter per (sequence, KV head)."""
    check_tensor(split_counters, "split_counters", ndim=1, dtypes=(torch.int32,), device=device)
    require(split_counters.is_contiguous(), "split_counters must be contiguous")
    need = num_seqs * num_kv_heads
    require(split_counters.numel() >= need,
            f"split_counters needs num_seqs x num_kv_heads = {need} entries, got {split_counters.numel()}")


# The schedule a fused-RoPE launch runs, per autotune key of the same launch without it: the config the
# autotuner picked there (the two compute alike, so one tuning serves both, and a step computes the same
# bits with the fusion on or off). Filled by `_followed_schedule`.
_FOLLOWED_SCHEDULES: dict[tuple, tuple[int, ...]] = {}


def _followed_schedule(key: tuple, tune) -> tuple[int, ...]:
    """The autotuned split kernel's schedule for `key` (the autotune key's values and the tensors'
    dtypes); `tune()` launches the kernel without RoPE once to tune it, the first time a key comes."""
    schedule = _FOLLOWED_SCHEDULES.get(key)
    if schedule is None:
        if len(_decode_split_kernel.configs) == 1:  # the interpreter's single config: nothing to time
            schedule = schedule_of(_decode_split_kernel.configs[0])
        else:
            tune()
            schedule = schedule_of(_decode_split_kernel.best_config)
        _FOLLOWED_SCHEDULES[key] = schedule
    return schedule


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fp8_via_float16: bool = True,
    fp8_variant: str | None = None,
    half_variant: str | None = None,
    schedule: tuple[int, ...] | None = None,
    compile_only: bool = False,
    split_counters: torch.Tensor | None = None,
    rope: DecodeRope | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    Args:
        q: [B, Hq, D] float16 / bfloat16, or float32 (q and the softmax weights then enter the dots as
            two terms of their dtype each, hi + lo, with float32 sums).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] in q's dtype, or float8_e4m3fn; with float32 q
            float16 / bfloat16 / float8_e4m3fn.
        block_tables: [B', max_blocks] int32 (B' >= B) physical block ids per sequence.
        seq_lens: [B] int32 context lengths (the new token included); 0 marks a padding row.
        scale: softmax scale.
        out: optional [B, Hq, D] output buffer in q's dtype or float32 (stored unrounded).
        num_splits: context splits per sequence; chosen from the shapes when None.
        max_seq_len: an upper bound on seq_lens (host int) that tightens the split size; the
            block-table width times the block size when None.
        k_scale, v_scale: [Hkv] float32 dequantization scales of an fp8 cache.
        fp8_via_float16: with an fp8 cache, run the dots in float16 (native e4m3 -> f16
            conversion; q clamped to +-65504) instead of upcasting the tiles to q's dtype.
        fp8_variant: with an fp8 cache and fp8_via_float16, the inner loop (a key of
            FP8_DECODE_VARIANTS; `choose_fp8_variant`'s when None); ignored for a bf16 / fp16 cache.
        half_variant: with a bf16 / fp16 cache, the inner loop (a key of HALF_DECODE_VARIANTS;
            `choose_half_variant`'s when None); ignored for an fp8 cache.
        schedule: (BLOCK_N, num_warps, num_stages[, maxnreg]) of the split kernel instead of
            autotuning (for benchmarks and tests; the pipeline keeps about (num_stages - 2) / 2 K/V
            tiles in flight; maxnreg caps the registers per thread).
        compile_only: compile the split kernel for these arguments without launching anything
            (inside triton's AsyncCompileMode the compile runs in its executor); out is returned
            unwritten.
        split_counters: [>= B * Hkv] int32, all zero: with it, a launch of several splits merges
            them inside the split kernel (the last split of each sequence and KV head to finish
            merges; no second launch), and leaves the counters at zero again. A persistent buffer
            (a CUDA graph keeps its address), used by one stream at a time. None: the merge kernel.
        rope: the new tokens' RoPE and cache write, fused (`DecodeRope`; q is then unrotated and the
            caches do not yet hold the new tokens). The split kernel runs the schedule the autotuner
            picked for the same launch without it (`_followed_schedule`) unless `schedule` is given.
    Returns:
        out [B, Hq, D].
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out, k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    max_context = block_tables.shape[1] * page_size if max_seq_len is None else int(max_seq_len)
    require(max_context >= 0, f"max_seq_len must be >= 0, got {max_seq_len}")
    require(num_seqs <= MAX_GRID_Y, f"at most {MAX_GRID_Y} sequences per launch, got {num_seqs}")
    sms = num_sms(q.device)
    plan = plan_decode_splits(num_seqs, num_kv_heads, max_context, sms, num_splits)
    # A tile spans whole pages or lies inside one, so splits must start on a page's or a 128-token tile's bound.
    require(split_granule(plan.min_tokens) % min(page_size, SPLIT_GRANULE) == 0,
            f"{SPLIT_TOKENS_ENV}={plan.min_tokens} must be a multiple of the {page_size}-token page")
    if fp8_variant is None:  # the upcast path (fp8_via_float16 false) has one loop
        chosen = fp8 and fp8_via_float16
        chosen = chosen and q.dtype != torch.float32  # a float32 q: f16 terms, not q8x2's e4m3 ones
        fp8_variant = choose_fp8_variant(plan, num_seqs, num_kv_heads, sms) if chosen else DEFAULT_FP8_VARIANT
    require(q.dtype != torch.float32 or not fp8 or fp8_via_float16, "a float32 q over an fp8 cache needs fp8_via_float16")
    meta = split_kernel_meta(fp8, fp8_via_float16, fp8_variant, half_variant or choose_half_variant())
    num_splits, single = plan.num_splits, plan.single
    if split_counters is not None:
        _check_split_counters(split_counters, num_seqs, num_kv_heads, q.device)
    fused = split_counters is not None and not single
    if single:
        partial_out = partial_lse = out  # unused
    else:
        partial_out = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    group = num_q_heads // num_kv_heads
    grid = (num_kv_heads, num_seqs, num_splits)
    args = (
        q, k_cache, v_cache, block_tables, seq_lens,
        out, partial_out, partial_lse, k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,
        split_counters if fused else seq_lens, float(scale) * LOG2_E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2) if not single else 0,
        partial_lse.stride(0), partial_lse.stride(1),
        plan.min_tokens, group, plan.split_bucket,
    )  # fmt: skip
    # k_new .. slot and their strides: never read. q stands in for the pointers: Triton specializes a pointer on
    # its 16-byte alignment, and q's rows always start on one, where seq_lens (a mixed step's decode rows start
    # after its prefills) would compile a second binary of the same launch for every prefill count not a
    # multiple of 4.
    no_rope = (q,) * 5 + (0,) * 5
    group_rows = max(16, next_power_of_2(group))  # the dots' 16 rows of mma.sync / wgmma
    if meta["VARIANT"] & GROUP_ROWS:
        group_rows = next_power_of_2(group)
    elif meta["VARIANT"] & PACKED:
        group_rows = max(8, next_power_of_2(group))  # hi and lo fill the dot's 16 columns
    pdl = pdl_launch_options(q.device)
    meta |= {"HEAD_DIM": head_dim, "BLOCK_G": group_rows, "PAGE_SIZE": page_size,
             "SINGLE_SPLIT": single, "FP8_KV": fp8, "FUSED_MERGE": fused,
             "MERGE_BLOCK": plan.merge_block if fused else 1, "MERGE_G": next_power_of_2(group) if fused else 1,
             "F32_TERMS": q.dtype == torch.float32, **pdl}  # fmt: skip
    if rope is None:
        kernel = _decode_split_kernel if schedule is None else _decode_split_kernel.fn
        args += no_rope
    else:
        rope.check(q, num_kv_heads)
        if schedule is None:
            require(not compile_only, "compile_only with rope needs a schedule")
            key = (q.dtype, k_cache.dtype, out.dtype, plan.split_bucket, tuple(sorted(meta.items())))
            schedule = _followed_schedule(key, lambda: _decode_split_kernel[grid](*args, *no_rope, **meta))
        kernel = _decode_split_kernel.fn
        args += rope.args()
        meta["ROTARY_DIM"] = rope.cos_sin_cache.shape[1]
    meta |= schedule_meta(schedule)
    if compile_only:
        if not is_interpreter():  # the interpreter compiles nothing
            kernel.warmup(*args, grid=grid, **meta)
        return out
    kernel[grid](*args, **meta)
    if not single and not fused:
        merge_splits(partial_out, partial_lse, seq_lens, out, plan, pdl)
    return out
