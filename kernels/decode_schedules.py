"""The decode split kernel's schedules and inner-loop variants, and how a launch picks them.

    GPU_CONFIGS / prune_configs: what the autotuner times (bf16 / fp16 caches: BF16_CONFIGS; fp8: FP8_CONFIGS)
    schedule_of(config) -> (BLOCK_N, warps, stages[, maxnreg]);  schedule_meta(schedule) -> launch keywords
    FP8_DECODE_VARIANTS / HALF_DECODE_VARIANTS: the VARIANT constexpr's bit flags per named loop
    choose_fp8_variant / choose_half_variant / split_kernel_meta: a launch's loop, checked

The kernel itself is sits.kernels.attention_decode's; the loops' tile steps are sits.kernels.decode_tiles'.
"""

from __future__ import annotations

import os

import triton

from sits.kernels.decode_splits import DecodeSplitPlan
from sits.kernels.launch_utils import require

__all__ = [
    "BF16_CONFIGS",
    "BF16_SCHEDULES",
    "DEFAULT_FP8_VARIANT",
    "DEFAULT_HALF_VARIANT",
    "FP8_CONFIGS",
    "FP8_DECODE_VARIANTS",
    "FP8_SCHEDULES",
    "FP8_VARIANT_ENV",
    "GPU_CONFIGS",
    "HALF_DECODE_VARIANTS",
    "HALF_VARIANT_ENV",
    "INTERPRETER_CONFIG",
    "SMALL_BATCH_FP8_VARIANT",
    "choose_fp8_variant",
    "choose_half_variant",
    "prune_configs",
    "schedule_meta",
    "schedule_of",
    "split_kernel_meta",
]


def _config(block_n, warps, stages, maxnreg=None):
    return triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages, maxnreg=maxnreg)


# Paged loads spend pipeline stages on the block-table read, so deep pipelines keep enough K/V bytes
# in flight per multiprocessor to stream at HBM speed. The K / V tiles a pipeline keeps in shared memory (Triton
# 3.9's sm_90a compile, the fused-RoPE launch at Llama-3-8B's layout): one at 4 stages, two at 5 or 6, three at 8.
# (128, 8, 5) double-buffers the batch-1 winner's 128-token tiles (139 KB of shared memory, 100 registers under
# Triton 3.6): both tiles of a 256-token split in flight at once, where (128, 8, 4) loads the second after the first
# is used. On an H100 (2026-12-05, bench_attention_decode_l2.py) that took batch 1's split kernel + merge from 12.01
# to 11.48 µs with K / V cold (9.3 µs hot either way) and lost 4 µs at batch 4; the autotuner times it beside the
# others.
BF16_CONFIGS = [
    _config(16, 4, 8),
    _config(32, 2, 8),
    _config(32, 4, 6),
    _config(32, 4, 8),
    _config(64, 4, 4),
    _config(64, 4, 6),
    _config(64, 8, 6),
    _config(128, 8, 4),
    _config(128, 8, 5),
]
# The fp8 config, for DEFAULT_FP8_VARIANT, measured on an H200 (swap_g_f, GB/s at batch 448 / 256 / 32):
# (64, 4, 8) 3,786 / 3,601 / 2,804 is within 5 % of the best at every batch >= 32, where (32, 2, 10)
# 3,870 / 3,763 / 2,084 loses a quarter at 32 and (128, 4, 8) 3,369 / 3,140 / 2,771 an eighth at 448.
# The autotune key has no batch size (the start-up pre-tune may run at another batch than the one
# served), so one robust config, not a list whose winner depends on the batch it was tuned at.
# Deeper pipelines lost (64-token tiles, 10 stages 3,487, 12 stages 3,030 at 448). (BLOCK_N, warps,
# stages[, maxnreg]); BLOCK_N stays <= SPLIT_GRANULE.
FP8_SCHEDULE_LIST: tuple[tuple[int, ...], ...] = ((64, 4, 8),)
FP8_CONFIGS = [_config(*schedule) for schedule in FP8_SCHEDULE_LIST]


def schedule_of(config):
    """(BLOCK_N, warps, stages), with maxnreg after them where the config caps registers."""
    schedule = (config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    return schedule + (config.maxnreg,) if config.maxnreg else schedule


BF16_SCHEDULES = {schedule_of(c) for c in BF16_CONFIGS}
FP8_SCHEDULES = {schedule_of(c) for c in FP8_CONFIGS}
GPU_CONFIGS = BF16_CONFIGS + [c for c in FP8_CONFIGS if schedule_of(c) not in BF16_SCHEDULES]
INTERPRETER_CONFIG = _config(32, 4, 1)  # block 16: gathered pages; block 64: one page


def prune_configs(configs, named_args, **kwargs):
    """The bf16 list for bf16 caches, the fp8 list for fp8 ones; BLOCK_N <= 64 at head_dim 256."""
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    fp8 = kwargs.get("FP8_KV", named_args.get("FP8_KV"))
    own = FP8_SCHEDULES if fp8 else BF16_SCHEDULES
    kept = [c for c in configs if schedule_of(c) in own or len(configs) == 1]
    kept = [c for c in kept if not (head_dim >= 256 and c.kwargs["BLOCK_N"] > 64)]
    return kept or configs[:1]


# Variants of the fp8-cache inner loop: the VARIANT constexpr (bit flags, used with FP8_F16). Each reads
# the same bytes; they differ in how the tiles reach the tensor cores (bench_attention_decode.py --fp8
# --variants times them). "base" is the first loop; DEFAULT_FP8_VARIANT is the measured winner.
K_T, SWAP, Q8X2, GROUP_ROWS, FULL_TILES, PACKED = 1, 2, 4, 8, 16, 32
FP8_DECODE_VARIANTS = {
    "base": 0,  # K tile [BLOCK_N, D] converted to f16, transposed in registers; q rows are the dots' M side
    "k_t": K_T,  # K loaded as [D, BLOCK_N] through its pointers, so the QK dot needs no tl.trans
    # Tokens as the dots' M side: S^T = K q^T [BLOCK_N, G] and out^T = V^T P^T [D, G]; from BLOCK_N = 64
    # on (4 warps) Hopper runs them as wgmma, where q's 4-row group as M (16 rows) can only use mma.sync.
    "swap": SWAP,
    # "swap" with q as two e4m3 terms per head (q ~ (hi + lo) * scale, about 7 mantissa bits): two
    # fp8 x fp8 wgmma read the K tile from shared memory as stored, no K conversion at all. (With q
    # rows as M, Triton runs fp8 dots as f16 mma.sync after converting both operands: no gain there.)
    "swap_q8x2": SWAP | Q8X2,
    # BLOCK_G = the GQA group (4 query heads) instead of 16 rows: Triton pads the dots' small side for
    # the tensor cores itself, so the softmax and the accumulator hold 4 rows, not 16 (smaller
    # registers, a quarter of the exp2s). Hopper then runs "swap" with mma.sync (wgmma wants 16).
    "base_g": GROUP_ROWS,
    "swap_g": SWAP | GROUP_ROWS,
    # The tiles wholly inside the split without masks (no per-token compare / select, unpredicated
    # copies), the one partial tile after them with masks.
    "base_f": FULL_TILES,
    "base_g_f": GROUP_ROWS | FULL_TILES,
    "swap_g_f": SWAP | GROUP_ROWS | FULL_TILES,
    "swap_q8x2_f": SWAP | Q8X2 | FULL_TILES,
    # "swap_q8x2_f" with hi and lo as the two halves of one fp8 dot's N side (the group padded to 8,
    # hi in columns 0-7, lo in 8-15): one wgmma per K step, hi + lo summed inside each thread, and
    # the softmax over 8 columns instead of 16.
    "swap_q8x2_p_f": SWAP | Q8X2 | FULL_TILES | PACKED,
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
HALF_DECODE_VARIANTS = {name: bits for name, bits in FP8_DECODE_VARIANTS.items() if not bits & (Q8X2 | PACKED)}
DEFAULT_HALF_VARIANT = "base"
HALF_VARIANT_ENV = "SITS_DECODE_VARIANT"  # a key of HALF_DECODE_VARIANTS: the half caches' loop instead


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


def split_kernel_meta(fp8: bool, fp8_via_float16: bool, fp8_variant: str, half_variant: str) -> dict:
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


def schedule_meta(schedule: tuple[int, ...] | None) -> dict:
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
