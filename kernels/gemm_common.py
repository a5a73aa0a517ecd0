"""Pieces shared by the GEMM kernels: grouped tile order and the split-K output reset."""

from __future__ import annotations

import triton
import triton.language as tl


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


def zero_output_before_launch(nargs: dict) -> None:
    """Config pre-hook of split-K configs: their programs add partial sums into c_ptr.

    Autotuning runs a config many times; the hook zeroes the buffer before every run, the final
    one included.
    """
    nargs["c_ptr"].zero_()
