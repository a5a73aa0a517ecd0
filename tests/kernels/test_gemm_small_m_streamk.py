"""The stream-K small-M GEMM (an equal share of the weight per program), against the reference.

On CPU the kernel runs in Triton's interpreter (fp16, 32 x 32 tiles). The program counts are chosen so that
column tiles are written whole, shared by two or three programs, and cut at ragged points; ragged N and a
short last K tile are covered, with the weight read through pointers and through a TMA descriptor, and so are
the folded decoder norms' epilogues (the stream fed in place, rows scaled by 1 / rms). The counters must be zero
after every launch, and bad input is refused.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels.gemm_small_m import sumsq_slots
from sits.kernels.gemm_small_m_streamk import (
    counters_needed,
    small_m_gemm_reference,
    small_m_gemm_streamk,
    small_m_gemm_streamk_to_stream,
    streamk_plan,
)
from sits.kernels.reference import small_m_gemm_rstd_reference, small_m_gemm_to_stream_reference
from tests.kernels.helpers import DEVICE, randn

# 32 x 32 tiles on either device, so the program counts below cut the same column tiles
CONFIG = {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2, "PROGRAMS_PER_SM": 1, "W_TMA": 0}
TOLERANCE = 3e-3  # one fp16 rounding of the output, relative to the largest |reference|


def _operands(m: int, n: int, k: int, seed: int, dtype=torch.float16):
    torch.manual_seed(seed)
    return randn(m, k, dtype=dtype), randn(n, k, dtype=dtype, scale=k**-0.5)


def _check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype and not out.isnan().any()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE * scale, rtol=TOLERANCE)


@pytest.mark.parametrize(
    ("units", "programs", "whole_tile_programs"),
    [(12, 12, False), (12, 4, True), (12, 5, False), (12, 7, False), (12, 1, True)],
)
def test_plan_counts_programs_and_segments(units, programs, whole_tile_programs):
    """Each column tile (3 K tiles here) is touched by at most the planned segments, and the grid never exceeds
    the units; with programs dividing the tiles evenly, every tile has one segment."""
    k_tiles = 3
    grid, segments = streamk_plan(32 * units // k_tiles, 32 * k_tiles, 32, 32, programs)
    assert grid == min(programs, units)
    ranges = [(p * units // grid, (p + 1) * units // grid) for p in range(grid)]
    touching = [
        sum(1 for lo, hi in ranges if lo < (t + 1) * k_tiles and hi > t * k_tiles)
        for t in range(units // k_tiles)
    ]
    assert max(touching) <= segments
    assert (max(touching) == 1) is whole_tile_programs


# (N, K): 4 column tiles x 3 K tiles; ragged N (the last tile past N); K = 80 leaves the last K tile short
@pytest.mark.parametrize(("n", "k"), [(128, 96), (100, 96), (64, 80)], ids=["whole", "ragged-n", "short-k"])
@pytest.mark.parametrize("programs", [1, 3, 5, 7, 12])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("tma", [0, 1], ids=["pointers", "descriptor"])
def test_matches_reference_and_leaves_the_counters_zero(m, n, k, programs, tma):
    x, w = _operands(m, n, k, seed=m + n + k + programs)
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device=DEVICE)
    config = dict(CONFIG, W_TMA=tma)
    for _ in range(2):  # the second launch reuses the counters the first one reset
        out = small_m_gemm_streamk(x, w, counters, config=config, programs=programs)
        _check(out, small_m_gemm_reference(x, w))
        assert counters.count_nonzero().item() == 0


def test_writes_into_out_and_takes_a_row_stride():
    x, w = _operands(5, 96, 64, seed=3)
    wide = torch.zeros(5, 80, dtype=x.dtype, device=DEVICE)
    wide[:, :64] = x
    out = torch.full((5, 96), float("nan"), dtype=x.dtype, device=DEVICE)
    counters = torch.zeros(counters_needed(96), dtype=torch.int32, device=DEVICE)
    assert small_m_gemm_streamk(wide[:, :64], w, counters, out=out, config=CONFIG, programs=4) is out
    _check(out, small_m_gemm_reference(x, w))


def test_no_rows_or_no_columns_launch_nothing():
    x, w = _operands(0, 64, 32, seed=1)
    counters = torch.zeros(counters_needed(64), dtype=torch.int32, device=DEVICE)
    assert small_m_gemm_streamk(x, w, counters).shape == (0, 64)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"config": {"BLOCK_N": 32}}, "a stream-K config has exactly"),
        ({"config": dict(CONFIG, BLOCK_N=16)}, "BLOCK_N must be a power of two >= 32"),
        ({"config": dict(CONFIG, BLOCK_K=0)}, "config values must be positive"),
        ({"config": dict(CONFIG, W_TMA=2)}, "W_TMA is 0 or 1"),
        ({"programs": 0}, "programs must be positive"),
    ],
)
def test_bad_configs_are_refused(kwargs, match):
    x, w = _operands(2, 64, 32, seed=2)
    counters = torch.zeros(counters_needed(64), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        small_m_gemm_streamk(x, w, counters, **kwargs)


def test_a_descriptor_needs_16_byte_rows():
    x, w = _operands(2, 64, 36, seed=5)  # 72-byte rows
    counters = torch.zeros(counters_needed(64), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        small_m_gemm_streamk(x, w, counters, config=dict(CONFIG, W_TMA=1))


def test_too_few_counters_are_refused():
    x, w = _operands(2, 128, 32, seed=4)
    with pytest.raises(ValueError, match="counters"):
        small_m_gemm_streamk(x, w, torch.zeros(1, dtype=torch.int32, device=DEVICE))


# The folded decoder norms' launches (runtime/models/norm_fold.py) on this kernel, at program counts that share
# column tiles: the epilogue runs once per tile, in whichever program writes it.
@pytest.mark.parametrize("programs", [3, 7])
@pytest.mark.parametrize("tma", [0, 1], ids=["pointers", "descriptor"])
def test_feeds_the_stream_and_leaves_its_sums_of_squares(programs, tma):
    x, w = _operands(5, 100, 96, seed=programs + tma)
    stream = randn(5, 100, dtype=torch.float32)
    expected_stream = stream.clone()
    expected_out, expected_squares = small_m_gemm_to_stream_reference(x, w, expected_stream)
    counters = torch.zeros(counters_needed(100), dtype=torch.int32, device=DEVICE)
    out, squares = small_m_gemm_streamk_to_stream(x, w, counters, stream, config=dict(CONFIG, W_TMA=tma),
                                                  programs=programs)  # fmt: skip
    torch.testing.assert_close(stream, expected_stream, atol=1e-3, rtol=1e-3)
    _check(out, expected_out)
    torch.testing.assert_close(squares, expected_squares, atol=1e-2, rtol=1e-3)
    assert counters.count_nonzero().item() == 0


@pytest.mark.parametrize("programs", [3, 7])
def test_scales_rows_by_the_folded_norm(programs):
    x, w = _operands(5, 100, 96, seed=programs)
    sumsq = randn(5, sumsq_slots(96), dtype=torch.float32).abs() * 10
    counters = torch.zeros(counters_needed(100), dtype=torch.int32, device=DEVICE)
    out = small_m_gemm_streamk(x, w, counters, config=CONFIG, programs=programs, sumsq=sumsq, eps=1e-5)
    _check(out, small_m_gemm_rstd_reference(x, w, sumsq, 1e-5))
    assert counters.count_nonzero().item() == 0


def test_fold_operands_are_checked():
    x, w = _operands(5, 64, 32, seed=6)
    counters = torch.zeros(counters_needed(64), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="stream"):
        small_m_gemm_streamk_to_stream(x, w, counters, torch.zeros(5, 63, device=DEVICE), config=CONFIG)
    with pytest.raises(ValueError, match="sumsq"):
        small_m_gemm_streamk(x, w, counters, config=CONFIG, sumsq=torch.zeros(5, 7, device=DEVICE))
