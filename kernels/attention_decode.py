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
launch, the same bits; see `_last_arrival` for the memory ordering); FUSED_MERGE_DEFAULT says whether
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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
from sits.kernels.launch_utils import (
    HALF_DTYPES,
    autotune,
    cdiv,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    is_interpreter,
    length_bucket,
    next_power_of_2,
    num_sms,
    require,
)
from sits.kernels.paged_kv import paged_tile_blocks
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.reference import paged_decode_attention_reference
from sits.kernels.rope_kv_write import rope_pair, store_cache

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
SPLIT_GRANULE = 128  # tokens; every split length is a multiple of every BLOCK_N below (`split_granule`)
_GRANULE = tl.constexpr(SPLIT_GRANULE)  # the same, for the jit functions
MIN_TOKENS_PER_SPLIT = 256
# The least tokens a split keeps, instead of MIN_TOKENS_PER_SPLIT (a multiple of SPLIT_TOKENS_QUANTUM): for A/B
# runs of the split count at small batches (benchmarks/gpu_profile_run.sh's -splitN steps). Under SPLIT_GRANULE
# it is the granule as well, so a 2,048-token context can spread over 32 or 64 splits (more programs per
# multiprocessor, each with fewer tokens; the tiles past a split's end are masked).
SPLIT_TOKENS_ENV = "SITS_DECODE_SPLIT_TOKENS"
SPLIT_TOKENS_QUANTUM = 16  # the smallest tile (BLOCK_N) and the default page: split starts stay on both
MAX_SPLITS = 64
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension (sequences)
# Whether callers that own split counters (the Triton attention back end) pass them, so split launches
# merge inside the split kernel (one launch) instead of in _decode_merge_kernel (two). Off until timed
# on an H200 (`bench_attention_decode.py --small-batch` prints both); switching it on is this line.
FUSED_MERGE_DEFAULT = False
# Whether the Triton attention back end runs the decode rows' RoPE + KV-cache write inside this kernel
# (`DecodeRope`) instead of as rope_and_cache_write's launch before it (SITS_DECODE_FUSED_ROPE=0 / 1 overrides).
# On: on the H200 (2026-12-03, Llama-3-8B shape) it takes a decode step from 4.592 to 4.537 ms at batch 1 and from
# 6.650 to 6.624 at batch 32, and tests/gpu/test_kernel_warmup.py finds nothing compiled after start-up with it on
# (benchmarks/RESULTS.md).
FUSED_ROPE_DEFAULT = True


def _config(block_n, warps, stages, maxnreg=None):
    return triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages, maxnreg=maxnreg)


# Paged loads spend pipeline stages on the block-table read, so deep pipelines keep enough K/V bytes
# in flight per multiprocessor to stream at HBM speed.
_BF16_CONFIGS = [
    _config(16, 4, 8),
    _config(32, 2, 8),
    _config(32, 4, 6),
    _config(32, 4, 8),
    _config(64, 4, 4),
    _config(64, 4, 6),
    _config(64, 8, 6),
    _config(128, 8, 4),
]
# The fp8 config, for DEFAULT_FP8_VARIANT, measured on an H200 (swap_g_f, GB/s at batch 448 / 256 / 32):
# (64, 4, 8) 3,786 / 3,601 / 2,804 is within 5 % of the best at every batch >= 32, where (32, 2, 10)
# 3,870 / 3,763 / 2,084 loses a quarter at 32 and (128, 4, 8) 3,369 / 3,140 / 2,771 an eighth at 448.
# The autotune key has no batch size (the start-up pre-tune may run at another batch than the one
# served), so one robust config, not a list whose winner depends on the batch it was tuned at.
# Deeper pipelines lost (64-token tiles, 10 stages 3,487, 12 stages 3,030 at 448). (BLOCK_N, warps,
# stages[, maxnreg]); BLOCK_N stays <= SPLIT_GRANULE.
_FP8_SCHEDULE_LIST: tuple[tuple[int, ...], ...] = ((64, 4, 8),)
_FP8_CONFIGS = [_config(*schedule) for schedule in _FP8_SCHEDULE_LIST]


def _schedule(config):
    """(BLOCK_N, warps, stages), with maxnreg after them where the config caps registers."""
    schedule = (config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    return schedule + (config.maxnreg,) if config.maxnreg else schedule


_BF16_SCHEDULES = {_schedule(c) for c in _BF16_CONFIGS}
_FP8_SCHEDULES = {_schedule(c) for c in _FP8_CONFIGS}
_GPU_CONFIGS = _BF16_CONFIGS + [c for c in _FP8_CONFIGS if _schedule(c) not in _BF16_SCHEDULES]
_INTERPRETER_CONFIG = _config(32, 4, 1)  # block 16: gathered pages; block 64: one page


def _prune_configs(configs, named_args, **kwargs):
    """The bf16 list for bf16 caches, the fp8 list for fp8 ones; BLOCK_N <= 64 at head_dim 256."""
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    fp8 = kwargs.get("FP8_KV", named_args.get("FP8_KV"))
    own = _FP8_SCHEDULES if fp8 else _BF16_SCHEDULES
    kept = [c for c in configs if _schedule(c) in own or len(configs) == 1]
    kept = [c for c in kept if not (head_dim >= 256 and c.kwargs["BLOCK_N"] > 64)]
    return kept or configs[:1]


# Arguments that change from step to step without changing the code are not specialized, so a
# step never recompiles what the start-up pre-tune built: the block-table row stride (the widest
# table of the batch), the partial buffers' strides (they follow the split count) and the
# addresses of per-sequence rows (a mixed step's decodes start after its prefills, also in the fused RoPE's
# positions and slots).
_VARYING_INTS = ["stride_block_table", "stride_po_seq", "stride_po_head", "stride_po_split", "stride_pl_seq",
                 "stride_pl_head", "min_split_tokens", "split_bucket"]
_VARYING_POINTERS = ["block_tables_ptr", "seq_lens_ptr", "k_scale_ptr", "v_scale_ptr", "split_counters_ptr",
                     "positions_ptr", "slot_ptr"]


# Variants of the fp8-cache inner loop: the VARIANT constexpr (bit flags, used with FP8_F16). Each reads
# the same bytes; they differ in how the tiles reach the tensor cores (bench_attention_decode.py --fp8
# --variants times them). "base" is the first loop; DEFAULT_FP8_VARIANT is the measured winner.
_K_T, _SWAP, _Q8X2, _GROUP_ROWS, _FULL_TILES, _PACKED = 1, 2, 4, 8, 16, 32
FP8_DECODE_VARIANTS = {
    "base": 0,  # K tile [BLOCK_N, D] converted to f16, transposed in registers; q rows are the dots' M side
    "k_t": _K_T,  # K loaded as [D, BLOCK_N] through its pointers, so the QK dot needs no tl.trans
    # Tokens as the dots' M side: S^T = K q^T [BLOCK_N, G] and out^T = V^T P^T [D, G]; from BLOCK_N = 64
    # on (4 warps) Hopper runs them as wgmma, where q's 4-row group as M (16 rows) can only use mma.sync.
    "swap": _SWAP,
    # "swap" with q as two e4m3 terms per head (q ~ (hi + lo) * scale, about 7 mantissa bits): two
    # fp8 x fp8 wgmma read the K tile from shared memory as stored, no K conversion at all. (With q
    # rows as M, Triton runs fp8 dots as f16 mma.sync after converting both operands: no gain there.)
    "swap_q8x2": _SWAP | _Q8X2,
    # BLOCK_G = the GQA group (4 query heads) instead of 16 rows: Triton pads the dots' small side for
    # the tensor cores itself, so the softmax and the accumulator hold 4 rows, not 16 (smaller
    # registers, a quarter of the exp2s). Hopper then runs "swap" with mma.sync (wgmma wants 16).
    "base_g": _GROUP_ROWS,
    "swap_g": _SWAP | _GROUP_ROWS,
    # The tiles wholly inside the split without masks (no per-token compare / select, unpredicated
    # copies), the one partial tile after them with masks.
    "base_f": _FULL_TILES,
    "base_g_f": _GROUP_ROWS | _FULL_TILES,
    "swap_g_f": _SWAP | _GROUP_ROWS | _FULL_TILES,
    "swap_q8x2_f": _SWAP | _Q8X2 | _FULL_TILES,
    # "swap_q8x2_f" with hi and lo as the two halves of one fp8 dot's N side (the group padded to 8,
    # hi in columns 0-7, lo in 8-15): one wgmma per K step, hi + lo summed inside each thread, and
    # the softmax over 8 columns instead of 16.
    "swap_q8x2_p_f": _SWAP | _Q8X2 | _FULL_TILES | _PACKED,
}
# What paged_decode_attention runs over an fp8 cache unless told otherwise: on one H200 (2026-12-02,
# `bench_attention_decode.py --fp8 --variants`, 32 q / 8 KV heads, head_dim 128) swap_g_f read the fp8
# cache at 3,870 GB/s at batch 448 / context 3,072 (0.917 of the copy bandwidth; base 3,147) and
# 3,763 GB/s at 256 / 2,048 (base 3,035), with base's error against the float32 reference.
DEFAULT_FP8_VARIANT = "swap_g_f"
# Where a launch is one split per sequence and its sequences x KV heads programs are at most two per
# multiprocessor (batch 32 at 8 KV heads on an H200's 132), swap_q8x2_p_f read the fp8 cache faster in the
# same sweep: 2,943 GB/s against swap_g_f's 2,804 at batch 32 / context 2,048 (and slower at 256: 3,543
# against 3,763). Its relative error is about twice swap_g_f's (1.6e-3 against 8.5e-4 at batch 448).
SMALL_BATCH_FP8_VARIANT = "swap_q8x2_p_f"
SMALL_BATCH_PROGRAMS_PER_SM = 2
FP8_VARIANT_ENV = "SITS_FP8_DECODE_VARIANT"  # a key of FP8_DECODE_VARIANTS: every launch's default instead
# The same loops over a bf16 / fp16 cache: those that take the tiles as stored (not the fp8 q's e4m3 terms).
# DEFAULT_HALF_VARIANT ("base": q rows as the dots' M side padded to 16, every tile masked) is the loop the
# half caches have always run; the others are timed against it (bench_attention_decode.py --small-batch,
# SITS_DECODE_VARIANT in gpu_profile_run.sh's -hv steps). On an H200 (2026-12-05) neither base_f nor swap_g_f
# shortened the decode step at batch 1 or 32, so base stays.
HALF_DECODE_VARIANTS = {name: bits for name, bits in FP8_DECODE_VARIANTS.items() if not bits & (_Q8X2 | _PACKED)}
DEFAULT_HALF_VARIANT = "base"
HALF_VARIANT_ENV = "SITS_DECODE_VARIANT"  # a key of HALF_DECODE_VARIANTS: the half caches' loop instead


@triton.jit
def _round_to_e4m3(x):
    """x (float32) rounded to the nearest e4m3 value, ties to even, for |x| <= 448 (float32 result).

    Done in integer arithmetic so the following cast to e4m3 is exact: Triton's interpreter rounds
    fp32 -> fp8 casts wrongly, the GPU does not. Normal range: 3 mantissa bits; below 2^-6 e4m3's
    subnormal grid of 2^-9 (nearest, ties away from zero: those values are < 1.6e-5 of the maximum)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = tl.where(x < 0, -tl.floor(-x * 512.0 + 0.5), tl.floor(x * 512.0 + 0.5)) * (1.0 / 512.0)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_rows_e4m3(q):
    """q [G, D] float32 -> (hi, lo, row_scale [G]) with q ~ (hi + lo) * row_scale[:, None], hi and lo
    e4m3: row_scale = max |q_row| / 448 (1 for an all-zero row), hi the e4m3 rounding of the scaled
    row, lo the e4m3 rounding of what hi leaves (hi + lo keep about 7 mantissa bits of q)."""
    amax = tl.max(tl.abs(q), 1)
    row_scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
    scaled = q / row_scale[:, None]
    hi = _round_to_e4m3(scaled)
    lo = _round_to_e4m3(scaled - hi)
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv), row_scale


@triton.jit
def _split_tokens(seq_len, num_splits, min_split_tokens):
    """Tokens in each split of a sequence of seq_len tokens over num_splits launched splits: its context cut into
    num_splits pieces rounded up to `split_granule`, at least min_split_tokens each (`split_tokens` on the host).
    Sized from the sequence's own length, not from the launch's bound on it, so a context much shorter than the
    block table's width (a CUDA graph's table spans max_model_len) still spreads over as many splits as it fills."""
    granule = tl.minimum(min_split_tokens, _GRANULE)  # SPLIT_GRANULE unless an A/B run asks for shorter splits
    even = (seq_len + num_splits - 1) // num_splits
    return tl.maximum((even + granule - 1) // granule * granule, min_split_tokens)


@triton.jit
def _filled_splits(seq_len, tokens_per_split, num_splits):
    """How many of the num_splits launched splits a sequence of seq_len tokens fills at tokens_per_split a split
    (`_split_tokens`; never more than launched, the minimum kept as a guard)."""
    return tl.minimum((seq_len + tokens_per_split - 1) // tokens_per_split, num_splits)


@triton.jit
def _rope_rows(row_ptrs, row_valid, cos_sin_row, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr):
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
def _load_rows(row_ptrs, row_valid, HEAD_DIM: tl.constexpr):
    """Rows [R, HEAD_DIM] at row_ptrs [R] (contiguous elements) as stored; invalid rows 0."""
    dims = tl.arange(0, HEAD_DIM)[None, :]
    return tl.load(row_ptrs[:, None] + dims, mask=row_valid[:, None], other=0.0)


@triton.jit
def _write_new_kv(k_new, v_new, slot, kv_head, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
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


@triton.jit
def _tile_rows(block_table_row, tile_start, end, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Row offsets of tokens tile_start .. + BLOCK_N in the paged K and V caches, and which lie before `end`."""
    valid = tile_start + tl.arange(0, BLOCK_N) < end
    blocks, slots = paged_tile_blocks(block_table_row, tile_start, end, PAGE_SIZE, BLOCK_N, MASKED)
    return blocks * stride_k_block + slots * stride_k_slot, blocks * stride_v_block + slots * stride_v_slot, valid


@triton.jit
def _tile_load(base, rows, offs_d, valid, TRANSPOSED: tl.constexpr, MASKED: tl.constexpr):
    """One tile of token rows: [BLOCK_N, D], or [D, BLOCK_N] when TRANSPOSED; rows past `end` read as 0 when MASKED."""
    if TRANSPOSED:
        if MASKED:
            tile = tl.load(base + rows[None, :] + offs_d[:, None], mask=valid[None, :], other=0.0)
        else:
            tile = tl.load(base + rows[None, :] + offs_d[:, None])
    else:
        if MASKED:
            tile = tl.load(base + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        else:
            tile = tl.load(base + rows[:, None] + offs_d[None, :])
    return tile


@triton.jit
def _rows_tile(acc, m_i, l_i, q, q_low, scale, tile_start, end, block_table_row, k_base, v_base,
               stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
               HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, K_T: tl.constexpr,
               MASKED: tl.constexpr, F32_TERMS: tl.constexpr):  # fmt: skip
    """One online-softmax step over tokens tile_start .. + BLOCK_N with the query heads as the dots'
    rows: acc [G, D], m_i / l_i [G] (log2 domain) in, updated out. MASKED: tokens past `end` excluded
    (else the whole tile must lie before `end`). K_T: K loaded as [D, BLOCK_N]. F32_TERMS (a float32
    query): q and P enter the dots as two terms of the dots' dtype each, S = q K^T + q_low K^T and
    P V = P_hi V + P_lo V (P_lo what P_hi leaves), all summed in float32."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_rows, v_rows, valid = _tile_rows(block_table_row, tile_start, end, stride_k_block, stride_k_slot,
                                       stride_v_block, stride_v_slot, PAGE_SIZE, BLOCK_N, MASKED)
    if K_T:
        k_t = _tile_load(k_base, k_rows, offs_d, valid, True, MASKED).to(q.dtype)
    else:
        k_t = tl.trans(_tile_load(k_base, k_rows, offs_d, valid, False, MASKED).to(q.dtype))
    if F32_TERMS:
        qk = tl.dot(q_low, k_t, tl.dot(q, k_t)) * scale
    else:
        qk = tl.dot(q, k_t) * scale
    if MASKED:
        qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _tile_load(v_base, v_rows, offs_d, valid, False, MASKED)
    if F32_TERMS:
        p_hi = p.to(q.dtype)
        v_dot = v.to(q.dtype)
        acc = tl.dot((p - p_hi.to(tl.float32)).to(q.dtype), v_dot, tl.dot(p_hi, v_dot, acc * alpha[:, None]))
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _swap_tile(acc_t, m_i, l_i, q_t, q_hi_t, q_lo_t, scale, tile_start, end, block_table_row, k_base, v_base,
               stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
               HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
               Q8X2: tl.constexpr, PACKED: tl.constexpr, MASKED: tl.constexpr, F32_TERMS: tl.constexpr):  # fmt: skip
    """_rows_tile with the tokens as the dots' rows: S^T = K q^T [BLOCK_N, G], acc_t = out^T [D, G].
    Q8X2: S^T = K (q_hi + q_lo)^T as two fp8 dots, scale [G] per query head (else a scalar).
    PACKED (with Q8X2): one fp8 dot against q_hi_t = [D, 2G] (hi's columns, then lo's), halves summed.
    F32_TERMS (a float32 query): S^T = K q_t + K q_lo_t unless Q8X2, and P as two terms, as in _rows_tile."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_rows, v_rows, valid = _tile_rows(block_table_row, tile_start, end, stride_k_block, stride_k_slot,
                                       stride_v_block, stride_v_slot, PAGE_SIZE, BLOCK_N, MASKED)
    k = _tile_load(k_base, k_rows, offs_d, valid, False, MASKED)
    if PACKED:  # K as stored: fp8 x fp8; column j * G + h -> [BLOCK_N, G, 2], summed over j
        s_hi, s_lo = tl.split(tl.permute(tl.reshape(tl.dot(k, q_hi_t), [BLOCK_N, 2, BLOCK_G]), (0, 2, 1)))
        s_t = (s_hi + s_lo) * scale[None, :]
    elif Q8X2:  # K as stored: fp8 x fp8
        s_t = tl.dot(k, q_lo_t, tl.dot(k, q_hi_t)) * scale[None, :]
    elif F32_TERMS:
        k_dot = k.to(q_t.dtype)
        s_t = tl.dot(k_dot, q_lo_t, tl.dot(k_dot, q_t)) * scale
    else:
        s_t = tl.dot(k.to(q_t.dtype), q_t) * scale
    if MASKED:
        s_t = tl.where(valid[:, None], s_t, float("-inf"))  # [BLOCK_N, G]
    m_new = tl.maximum(m_i, tl.max(s_t, 0))
    p_t = tl.math.exp2(s_t - m_new[None, :])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p_t, 0)
    v_t = _tile_load(v_base, v_rows, offs_d, valid, True, MASKED)
    if F32_TERMS:
        p_hi_t = p_t.to(q_t.dtype)
        v_dot = v_t.to(q_t.dtype)
        acc_t = tl.dot(v_dot, (p_t - p_hi_t.to(tl.float32)).to(q_t.dtype), tl.dot(v_dot, p_hi_t, acc_t * alpha[None, :]))
    else:
        acc_t = tl.dot(v_t.to(q_t.dtype), p_t.to(q_t.dtype), acc_t * alpha[None, :])
    return acc_t, m_new, l_i


@triton.jit
def _merge_partials(po_rows, pl_rows, row_valid, stride_po_split, num_valid,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BYPASS_L1: tl.constexpr):  # fmt: skip
    """Merged outputs [R, HEAD_DIM] float32 of R query heads from their splits' partials.

    po_rows [R] points at each head's partial output of split 0 (split s at + s * stride_po_split,
    HEAD_DIM float32 each), pl_rows [R] at its log-sum-exp of split 0 (split s at + s, log2 domain);
    row_valid [R] masks heads. Splits 0 .. num_valid - 1 count: out = sum_s w_s * o_s / sum_s w_s
    with w_s = 2^(lse_s - max lse); zeros when num_valid is 0 (a padding row).

    The splits are added one after another in split order, element by element (BLOCK_S unrolled,
    masked past num_valid: those add exact zeros), never through a tl.sum, whose order follows the
    register layout and so the kernel's warps. Both callers (the merge kernel, and the split kernel's
    fused merge at any schedule) therefore compute bit-identical outputs. BYPASS_L1 loads with
    .cg (for partials other programs wrote during this launch, see _last_arrival)."""
    offs_d = tl.arange(0, HEAD_DIM)
    lse_max = tl.full(po_rows.shape, float("-inf"), dtype=tl.float32)
    for s in tl.static_range(BLOCK_S):  # max is exact in any order
        valid = row_valid & (tl.full(po_rows.shape, s, tl.int32) < num_valid)  # (a vector: the interpreter)
        if BYPASS_L1:
            lse_s = tl.load(pl_rows + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
        else:
            lse_s = tl.load(pl_rows + s, mask=valid, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse_s)
    lse_max = tl.where(row_valid & (num_valid > 0), lse_max, 0.0)  # no inf - inf in empty rows
    acc = tl.zeros([po_rows.shape[0], HEAD_DIM], dtype=tl.float32)
    total = tl.zeros(po_rows.shape, dtype=tl.float32)
    for s in tl.static_range(BLOCK_S):
        valid = row_valid & (tl.full(po_rows.shape, s, tl.int32) < num_valid)  # (a vector: the interpreter)
        rows = po_rows[:, None] + s * stride_po_split + offs_d[None, :]
        if BYPASS_L1:
            lse_s = tl.load(pl_rows + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
            partial = tl.load(rows, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        else:
            lse_s = tl.load(pl_rows + s, mask=valid, other=float("-inf"))
            partial = tl.load(rows, mask=valid[:, None], other=0.0)
        weight = tl.math.exp2(lse_s - lse_max)
        acc = acc + partial * weight[:, None]
        total = total + weight
    return acc / tl.where(total > 0.0, total, 1.0)[:, None]


@triton.jit
def _store_group_rows(out_ptr, seq, kv_head, group_size, stride_o_seq, stride_o_head, rows,
                      HEAD_DIM: tl.constexpr, MERGE_G: tl.constexpr):  # fmt: skip
    """rows [MERGE_G, HEAD_DIM] float32 -> out[seq, the KV head's query heads] (rows past the group dropped)."""
    offs_g = tl.arange(0, MERGE_G)
    offs_d = tl.arange(0, HEAD_DIM)
    q_heads = kv_head * group_size + offs_g
    dst = out_ptr + seq * stride_o_seq + q_heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(dst, rows.to(out_ptr.dtype.element_ty), mask=(offs_g < group_size)[:, None])


@triton.jit
def _last_arrival(counter_ptr, num_valid):
    """True in exactly one of the num_valid programs that call this once per launch on one counter
    (the last to arrive), which also resets the counter to 0 for the next launch.

    Ordering (the PTX memory model; Triton runs a scalar atomic in one thread and hands its result
    to the others through shared memory behind a barrier):
    * release: the caller's partial stores come first in program order; the barrier orders every
      thread's stores before the atomic, and the atomic's release (acq_rel, gpu scope) is cumulative,
      so it publishes them all at gpu scope before the count can be seen.
    * acquire: the last arrival reads the count num_valid - 1 with acquire semantics; the increments
      before it are read-modify-writes of the same counter, so they all lie in one release sequence
      that it reads from, and every other program's release happens before its later loads; the barrier after the atomic keeps all its threads' loads after the acquire, and
      the caller loads with .cg (L2, never a stale L1 line).
    * reset: every program of this launch has incremented by then and none touches the counter
      again, so a plain store of 0 suffices; the next launch on the stream sees it (kernel boundary).
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = arrived == num_valid - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


@triton.jit
def _fused_merge(partial_out_ptr, partial_lse_ptr, out_ptr, split_counters_ptr, seq, kv_head, num_valid,
                 group_size, stride_po_seq, stride_po_head, stride_po_split,
                 stride_pl_seq, stride_pl_head, stride_o_seq, stride_o_head,
                 HEAD_DIM: tl.constexpr, MERGE_BLOCK: tl.constexpr, MERGE_G: tl.constexpr):  # fmt: skip
    """After a non-empty split stored its partials: the last of the sequence's num_valid non-empty splits
    (`_filled_splits`) to finish (counted on the int32 counter split_counters[seq * num_kv_heads + kv_head],
    which is 0 before the launch and after it) merges all of them for the KV head's query heads, as
    `_decode_merge_kernel` does (`_merge_partials`, so bit for bit), and writes out. Empty splits return before
    they get here and never count."""
    counter = split_counters_ptr + seq * tl.num_programs(0) + kv_head
    if _last_arrival(counter, num_valid):
        offs_g = tl.arange(0, MERGE_G)
        q_heads = kv_head * group_size + offs_g
        merged = _merge_partials(
            partial_out_ptr + seq * stride_po_seq + q_heads * stride_po_head,
            partial_lse_ptr + seq * stride_pl_seq + q_heads * stride_pl_head,
            offs_g < group_size, stride_po_split, num_valid, HEAD_DIM, MERGE_BLOCK, True,
        )  # fmt: skip
        _store_group_rows(out_ptr, seq, kv_head, group_size, stride_o_seq, stride_o_head, merged, HEAD_DIM, MERGE_G)


@autotune(_GPU_CONFIGS, _INTERPRETER_CONFIG, ["HEAD_DIM", "PAGE_SIZE", "BLOCK_G", "FP8_KV", "FP8_F16", "VARIANT",
           "SINGLE_SPLIT", "FUSED_MERGE", "MERGE_BLOCK", "split_bucket"],
          _prune_configs)
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
    `_fused_merge` (MERGE_BLOCK: the merge's BLOCK_S; MERGE_G: the GQA group as a power of two).
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
        v_new = _load_rows(v_new_ptr + seq * stride_vn_seq + kv_head * stride_vn_head + new_row, new_row < 1,
                           HEAD_DIM)
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq).to(tl.int64) * stride_cos_sin
        k_new = _rope_rows(k_new_ptr + seq * stride_kn_seq + kv_head * stride_kn_head + new_row, new_row < 1,
                           cos_sin_row, HEAD_DIM, ROTARY_DIM)
        # rounded to q's dtype, as rope_and_cache_write stores it
        q = _rope_rows(q_rows, head_valid, cos_sin_row, HEAD_DIM, ROTARY_DIM).to(q_ptr.dtype.element_ty)
    else:
        q = _load_rows(q_rows, head_valid, HEAD_DIM)
    tokens_per_split = _split_tokens(seq_len, tl.num_programs(2), min_split_tokens)
    start = split * tokens_per_split
    if ROTARY_DIM > 0:
        # Exactly one program per (sequence, KV head) writes the new token, before any early return: the
        # split holding position seq_len - 1 (split 0 for a padding row; the last launched one past them).
        writer = tl.minimum(tl.maximum(seq_len - 1, 0) // tokens_per_split, tl.num_programs(2) - 1)
        if split == writer:
            _write_new_kv(k_new, v_new, slot, kv_head, k_cache_ptr, v_cache_ptr,
                          k_scale_ptr, v_scale_ptr, stride_k_block, stride_k_slot, stride_k_head,
                          stride_v_block, stride_v_slot, stride_v_head,
                          PAGE_SIZE, FP8_KV)  # fmt: skip
    if not SINGLE_SPLIT and start >= seq_len:
        if FUSED_MERGE and split == 0:  # nothing arrives for a padding row (seq_len 0): split 0 writes zeros
            _store_group_rows(out_ptr, seq, kv_head, group_size, stride_o_seq, stride_o_head,
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
            q_hi, q_lo, q_row_scale = _quantize_rows_e4m3(q_wide)
        else:
            q_hi, q_lo, q_row_scale = _quantize_rows_e4m3(q.to(tl.float32))
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
                acc_t, m_i, l_i = _swap_tile(
                    acc_t, m_i, l_i, q_t, q_hi_t, q_lo_t, row_scale_q, tile_start, end, block_table_row, k_base,
                    v_base, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
                    HEAD_DIM, PAGE_SIZE, BLOCK_N, BLOCK_G, VARIANT & 4, VARIANT & 32, masked == 1, F32_TERMS,
                )  # fmt: skip
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        for masked in tl.static_range(2):  # the full tiles unmasked, then the rest masked
            for tile_start in range(full_end if masked else start, end if masked else full_end, BLOCK_N):
                acc, m_i, l_i = _rows_tile(
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
            filled = _filled_splits(seq_len, _split_tokens(seq_len, tl.num_programs(2), min_split_tokens),
                                    tl.num_programs(2))
            _fused_merge(partial_out_ptr, partial_lse_ptr, out_ptr, split_counters_ptr, seq, kv_head, filled,
                         group_size, stride_po_seq, stride_po_head, stride_po_split,
                         stride_pl_seq, stride_pl_head, stride_o_seq, stride_o_head,
                         HEAD_DIM, MERGE_BLOCK, MERGE_G)  # fmt: skip


@triton.jit(do_not_specialize=["stride_pl_seq", "stride_pl_head", "min_split_tokens", "num_splits"],
            do_not_specialize_on_alignment=["seq_lens_ptr"])
def _decode_merge_kernel(
    partial_out_ptr, partial_lse_ptr, seq_lens_ptr, out_ptr,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_o_seq, stride_o_head,
    min_split_tokens, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """out = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse), over non-empty splits
    (`_merge_partials` for one query head per program)."""
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_valid = _filled_splits(seq_len, _split_tokens(seq_len, num_splits, min_split_tokens), num_splits)
    row = tl.arange(0, 1)
    merged = _merge_partials(
        partial_out_ptr + seq * stride_po_seq + head * stride_po_head + row,
        partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + row,
        row < 1, stride_po_split, num_valid, HEAD_DIM, BLOCK_S, False,
    )  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM)
    dst = out_ptr + seq * stride_o_seq + head * stride_o_head + row[:, None] + offs_d[None, :]
    tl.store(dst, merged.to(out_ptr.dtype.element_ty))


def min_split_tokens() -> int:
    """The least tokens a split keeps: SITS_DECODE_SPLIT_TOKENS when set (a positive multiple of
    SPLIT_TOKENS_QUANTUM), else MIN_TOKENS_PER_SPLIT."""
    forced = os.environ.get(SPLIT_TOKENS_ENV, "").strip()
    if not forced:
        return MIN_TOKENS_PER_SPLIT
    require(forced.isdigit() and int(forced) > 0 and int(forced) % SPLIT_TOKENS_QUANTUM == 0,
            f"{SPLIT_TOKENS_ENV} must be a positive multiple of {SPLIT_TOKENS_QUANTUM}, got {forced!r}")
    return int(forced)


def split_granule(min_tokens: int) -> int:
    """What split lengths are rounded up to: SPLIT_GRANULE, or min_tokens where that is shorter (an A/B run's
    SITS_DECODE_SPLIT_TOKENS under 128), so splits start on whole tiles and pages."""
    return min(min_tokens, SPLIT_GRANULE)


def split_count(num_seqs: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """Context splits: none when sequences x KV heads fill the GPU's `sms` multiprocessors, else
    about 4 programs per multiprocessor.

    Each split keeps at least `min_split_tokens()` tokens, so short contexts are not split into
    pieces whose merge costs more than it saves. Non-decreasing in max_context.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= sms:
        return 1  # on an H200, splitting a batch that already fills the GPU only added the merge's cost
    wanted = 4 * sms // programs
    most = max(1, max_context // min_split_tokens())
    return max(1, min(wanted, most, MAX_SPLITS))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """`split_count` on this device's multiprocessors."""
    return split_count(num_seqs, num_kv_heads, max_context, num_sms(device))


@dataclass(frozen=True)
class DecodeSplitPlan:
    """How one launch cuts its contexts, and the compile / autotune keys that follow.

    The launch sizes each sequence's splits from its own length (`split_tokens`, in the kernel): a sequence
    of max_context tokens gets tokens_per_split-token splits, a shorter one shorter splits (at least min_tokens),
    so it spreads over as many of the launched splits as it fills. CUDA graphs launch with max_context = the
    block table's width (max_model_len), however short the contexts they run.

    Attributes:
        requested_splits: the split count asked for (`split_count`, or the caller's num_splits).
        num_splits: splits launched: ceil(max_context / tokens_per_split).
        tokens_per_split: tokens per split of a max_context-token sequence, a multiple of SPLIT_GRANULE (the whole
            context with one split): the most any split of the launch holds.
        min_tokens: the least tokens a split of a sequence holds (`min_split_tokens()` for a chosen count,
            SPLIT_GRANULE for the caller's).
    """

    requested_splits: int
    num_splits: int
    tokens_per_split: int
    min_tokens: int

    @property
    def single(self) -> bool:
        """One split: the split kernel writes the output and no merge runs."""
        return self.num_splits == 1

    def tokens_for(self, seq_len: int) -> int:
        """Tokens in each split of a sequence of seq_len tokens (`split_tokens` over the launched splits)."""
        return split_tokens(seq_len, self.num_splits, self.min_tokens)

    @property
    def split_bucket(self) -> int:
        """The split kernel's autotune bucket (a power of two >= tokens_per_split)."""
        return length_bucket(self.tokens_per_split, cap=1 << 20)

    @property
    def merge_block(self) -> int:
        """The merge kernel's BLOCK_S (a compile-time size), 0 when no merge runs.

        It follows the requested count, which is constant over a range of context lengths, so
        fewer sizes get compiled; splits past num_splits are masked."""
        return 0 if self.single else max(2, next_power_of_2(self.requested_splits))

    @property
    def key(self) -> tuple[bool, int, int]:
        """(single, split_bucket, merge_block): what selects the launch's compiled kernels."""
        return self.single, self.split_bucket, self.merge_block


def plan_decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, sms: int,
                       num_splits: int | None = None) -> DecodeSplitPlan:
    """The split plan of a launch over num_seqs sequences whose contexts are at most max_context
    tokens, on a GPU of `sms` multiprocessors (num_splits: the caller's count, else `split_count`)."""
    requested = split_count(num_seqs, num_kv_heads, max_context, sms) if num_splits is None else int(num_splits)
    require(requested >= 1, f"num_splits must be >= 1, got {num_splits}")
    min_tokens = min_split_tokens() if num_splits is None else SPLIT_GRANULE
    granule = split_granule(min_tokens)
    tokens_per_split = max(granule, cdiv(cdiv(max(max_context, 1), requested), granule) * granule)
    launched = max(1, cdiv(max_context, tokens_per_split))
    if launched == 1:
        tokens_per_split = max(tokens_per_split, max_context)
    return DecodeSplitPlan(requested, launched, tokens_per_split, min_tokens)


def split_tokens(seq_len: int, num_splits: int, min_tokens: int) -> int:
    """Tokens in each split of a sequence of seq_len tokens over num_splits launched splits, as the kernels size
    them (`_split_tokens`): ceil(seq_len / num_splits) rounded up to `split_granule(min_tokens)`, at least
    min_tokens. The sequence fills ceil(seq_len / that) of the splits (none for seq_len 0); the rest return at once."""
    granule = split_granule(min_tokens)
    return max(cdiv(cdiv(seq_len, num_splits), granule) * granule, min_tokens)


def choose_fp8_variant(plan: DecodeSplitPlan, num_seqs: int, num_kv_heads: int, sms: int) -> str:
    """The fp8 inner loop a launch runs unless its caller names one: SITS_FP8_DECODE_VARIANT when set,
    else SMALL_BATCH_FP8_VARIANT for a single-split launch of at most SMALL_BATCH_PROGRAMS_PER_SM programs
    (sequences x KV heads) per multiprocessor, else DEFAULT_FP8_VARIANT."""
    forced = os.environ.get(FP8_VARIANT_ENV, "").strip()
    if forced:
        require(forced in FP8_DECODE_VARIANTS,
                f"{FP8_VARIANT_ENV} must be one of {sorted(FP8_DECODE_VARIANTS)}, got {forced!r}")
        return forced
    if plan.single and num_seqs * num_kv_heads <= SMALL_BATCH_PROGRAMS_PER_SM * sms:
        return SMALL_BATCH_FP8_VARIANT
    return DEFAULT_FP8_VARIANT


def choose_half_variant() -> str:
    """The inner loop a launch over a bf16 / fp16 cache runs unless its caller names one: SITS_DECODE_VARIANT
    when set (a key of HALF_DECODE_VARIANTS), else DEFAULT_HALF_VARIANT."""
    forced = os.environ.get(HALF_VARIANT_ENV, "").strip()
    if forced:
        require(forced in HALF_DECODE_VARIANTS,
                f"{HALF_VARIANT_ENV} must be one of {sorted(HALF_DECODE_VARIANTS)}, got {forced!r}")
        return forced
    return DEFAULT_HALF_VARIANT


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


def _split_kernel_meta(fp8: bool, fp8_via_float16: bool, fp8_variant: str, half_variant: str) -> dict:
    """The split kernel's FP8_F16 / VARIANT constexprs, after checking the caller's choices."""
    require(fp8_variant in FP8_DECODE_VARIANTS,
            f"fp8_variant must be one of {sorted(FP8_DECODE_VARIANTS)}, got {fp8_variant!r}")
    require(half_variant in HALF_DECODE_VARIANTS,
            f"half_variant must be one of {sorted(HALF_DECODE_VARIANTS)}, got {half_variant!r}")
    variant = FP8_DECODE_VARIANTS[fp8_variant] if fp8 else HALF_DECODE_VARIANTS[half_variant]
    if not fp8_via_float16:  # the first implementation has one loop: the tiles upcast to q's dtype
        require(fp8_variant in ("base", DEFAULT_FP8_VARIANT), f"fp8_variant {fp8_variant!r} needs fp8_via_float16=True")
        variant = 0
    return {"FP8_F16": fp8 and bool(fp8_via_float16), "VARIANT": variant}


def _schedule_meta(schedule: tuple[int, ...] | None) -> dict:
    """BLOCK_N / num_warps / num_stages (/ maxnreg) of a fixed schedule (no autotuning); {} for None."""
    meta: dict = {}
    if schedule is not None:
        require(len(schedule) in (3, 4) and all(isinstance(x, int) and x > 0 for x in schedule),
                f"schedule must be (BLOCK_N, num_warps, num_stages[, maxnreg]) positive ints, got {schedule!r}")
        block_n, warps, stages = schedule[:3]
        require(block_n >= 16 and block_n & (block_n - 1) == 0 and block_n <= 256,
                f"schedule BLOCK_N must be a power of two in 16..256, got {block_n}")
        meta |= {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        if len(schedule) == 4:
            meta["maxnreg"] = schedule[3]  # registers per thread at most: more programs per multiprocessor
    return meta


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
            schedule = _schedule(_decode_split_kernel.configs[0])
        else:
            tune()
            schedule = _schedule(_decode_split_kernel.best_config)
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
    meta = _split_kernel_meta(fp8, fp8_via_float16, fp8_variant, half_variant or choose_half_variant())
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
    if meta["VARIANT"] & _GROUP_ROWS:
        group_rows = next_power_of_2(group)
    elif meta["VARIANT"] & _PACKED:
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
    meta |= _schedule_meta(schedule)
    if compile_only:
        if not is_interpreter():  # the interpreter compiles nothing
            kernel.warmup(*args, grid=grid, **meta)
        return out
    kernel[grid](*args, **meta)
    if not single and not fused:
        _decode_merge_kernel[(num_seqs, num_q_heads)](
            partial_out, partial_lse, seq_lens, out,
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            out.stride(0), out.stride(1),
            plan.min_tokens, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=plan.merge_block,
            num_warps=4, **pdl,
        )  # fmt: skip
    return out
