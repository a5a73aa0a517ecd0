"""Pieces shared by the GEMM kernels: autotune configs, grouped tile order, split-K ranges, the
output store and the split-K output reset."""

from __future__ import annotations

import triton
import triton.language as tl


def zero_output_before_launch(nargs: dict) -> None:
    """Config pre-hook of split-K configs: their programs add partial sums into c_ptr.

    Autotuning runs a config many times; the hook zeroes the buffer before every run, the final
    one included.
    """
    nargs["c_ptr"].zero_()


def gemm_config(bm, bn, bk, warps, stages, split_k: int | None = 1, group_m=8, atomic=False, pre_hook=None,
                **flags) -> triton.Config:
    """One autotune config of a (split-K) GEMM kernel: BLOCK_M x BLOCK_N output tiles over BLOCK_K
    slices of K, SPLIT_K programs per tile along K (atomic adds into a zeroed float32 output when
    `atomic`; None: a kernel without SPLIT_K), GROUP_M row tiles per group; `pre_hook` runs before
    each launch (atomic configs zero the output instead); `flags` are the kernel's further constexpr
    switches."""
    split = {} if split_k is None else {"SPLIT_K": split_k}
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **split, "GROUP_M": group_m, **flags},
        num_warps=warps,
        num_stages=stages,
        pre_hook=zero_output_before_launch if atomic else pre_hook,
    )


def gemm_configs(tiles_by_schedule: dict[tuple[int, int], tuple[tuple[int, int, int], ...]],
                 **options) -> list[triton.Config]:
    """The large-M configs of a GEMM kernel: `gemm_config` of each (BLOCK_M, BLOCK_N, BLOCK_K) tile
    under its (num_warps, num_stages) schedule, in table order; `options` go to every config."""
    return [
        gemm_config(bm, bn, bk, warps, stages, **options)
        for (warps, stages), tiles in tiles_by_schedule.items()
        for bm, bn, bk in tiles
    ]


def split_k_configs(block_ns, splits_and_stages, **flags) -> list[triton.Config]:
    """The decode-sized (small M) configs: row tiles of 16 or 64, each column tile in `block_ns`,
    K tiles of 128 and each (SPLIT_K, pipeline stages) in `splits_and_stages`, adding atomically."""
    return [
        gemm_config(bm, bn, 128, 4, stages, split_k=split, atomic=True, **flags)
        for bm in (16, 64)
        for bn in block_ns
        for split, stages in splits_and_stages
    ]


def split_k_grid(m: int, n: int):
    """The launch grid of an [m, n] output: (output tiles, SPLIT_K); configs without SPLIT_K use 1."""

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), meta.get("SPLIT_K", 1))

    return grid


@triton.jit
def grouped_tile_coordinates(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped order.

    GROUP_M row tiles walk the column tiles together, so the weight tiles they share are still
    in L2 when the next row tile of the group needs them.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def split_k_tile(M, N, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """This program's output tile and share of K, for a grid of (output tiles, SPLIT_K).

    Returns offs_m [BLOCK_M] and offs_n [BLOCK_N] (the tile's row and column indices), rows_a and
    rows_b (the same wrapped into [0, M) and [0, N), int64, so the loads need no row mask; the
    store masks the extra rows), and the K tiles [first, last) this program sums.
    """
    pid_m, pid_n = grouped_tile_coordinates(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M).to(tl.int64)
    rows_b = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N).to(tl.int64)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = tl.program_id(1) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, k_tiles)
    return offs_m, offs_n, rows_a, rows_b, first, last


@triton.jit
def store_tile(acc, c_ptr, offs_m, offs_n, M, N, stride_cm, ATOMIC: tl.constexpr):
    """Write the float32 tile `acc` [BLOCK_M, BLOCK_N] at rows offs_m, columns offs_n of c [M, N]
    (row stride stride_cm): added atomically (split-K partial sums) or stored in c's dtype."""
    ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
