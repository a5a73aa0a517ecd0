"""The vocabulary argmax kernel against torch.argmax: same index for every row, ties and special values included."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.argmax import (
    BLOCK,
    KERNEL_MAX_ROWS,
    MAX_CHUNKS,
    argmax_chunks,
    argmax_rows,
    argmax_rows_reference,
    kernel_is_faster,
)
from tests.kernels.helpers import DEVICE, randn


def check(logits: torch.Tensor) -> None:
    expected = argmax_rows_reference(logits)
    got = argmax_rows(logits)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, BLOCK), (2, BLOCK + 1), (5, 3 * BLOCK - 5), (2, 49152),
                                   (1, 128256), (40, 2 * BLOCK + 3)])
def test_matches_torch_argmax_on_random_rows(shape):
    torch.manual_seed(sum(shape))
    check(randn(*shape, scale=3.0))


def test_ties_take_the_first_column_across_tiles_and_chunks():
    logits = randn(4, 5 * BLOCK, scale=0.1)
    logits[0, [17, 900, 4000]] = 5.0  # within one tile and across tiles
    logits[1, [2 * BLOCK + 3, 4 * BLOCK + 1]] = 5.0  # across chunks
    logits[2] = 1.0  # every column equal
    logits[3, [-1]] = 9.0  # the last column
    check(logits)
    assert argmax_rows(logits).tolist() == [17, 2 * BLOCK + 3, 0, 5 * BLOCK - 1]


def test_special_values_follow_torch():
    inf, nan = float("inf"), float("nan")
    logits = randn(6, 3 * BLOCK)
    logits[0, [5, 2500]] = inf  # first +inf
    logits[1, 2000] = inf
    logits[1, 2600] = nan  # NaN beats +inf: its index
    logits[2, [100, 1500]] = nan  # first NaN
    logits[3] = -inf  # all -inf: column 0
    logits[4] = 0.0
    logits[4, :7] = -0.0  # -0.0 equals +0.0: column 0 wins
    logits[5] = -1e30
    logits[5, 1234] = -1e29
    check(logits)
    assert argmax_rows(logits).tolist()[:5] == [5, 2600, 100, 0, 0]


def test_row_stride_and_out_buffer():
    wide = randn(3, 2 * BLOCK + 64)
    logits = wide[:, : 2 * BLOCK]  # rows 2 * BLOCK + 64 apart
    out = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(logits, out=out) is out
    assert torch.equal(out, logits.argmax(dim=-1))


def test_empty_batch():
    assert argmax_rows(randn(0, 10)).shape == (0,)


@pytest.mark.parametrize(
    ("logits", "match"),
    [
        (lambda: torch.zeros(4, device=DEVICE), "2 dimensions"),
        (lambda: torch.zeros(2, 3, dtype=torch.float16, device=DEVICE), "dtype"),
        (lambda: torch.zeros(2, 0, device=DEVICE), "at least one column"),
        # made on the device and then sliced: `.to(device)` of a strided CPU view would copy it contiguous
        (lambda: torch.zeros(4, 6, device=DEVICE)[:, ::2], "contiguous last dimension"),
    ],
    ids=["1d", "float16", "no-columns", "strided-columns"],
)
def test_bad_input_is_a_value_error(logits, match):
    with pytest.raises(ValueError, match=match):
        argmax_rows(logits())


def test_bad_out_is_a_value_error():
    with pytest.raises(ValueError, match="int64"):
        argmax_rows(randn(2, 8), out=torch.zeros(2, dtype=torch.int32, device=DEVICE))


def test_the_kernel_runs_only_where_it_beats_torch():
    """Greedy sampling calls the kernel at small batches (measured faster) and torch.argmax past them."""
    assert kernel_is_faster(torch.zeros(1, 8)) and kernel_is_faster(torch.zeros(KERNEL_MAX_ROWS, 8))
    assert not kernel_is_faster(torch.zeros(KERNEL_MAX_ROWS + 1, 8))
    assert not kernel_is_faster(torch.zeros(8, 4)[:, ::2])


def test_chunks_cover_the_row_and_fill_the_gpu():
    assert argmax_chunks(1, 128256, 132) == (126, BLOCK)  # 126 tiles, one per chunk: 126 programs
    assert argmax_chunks(32, 128256, 132) == (16, 8 * BLOCK)  # 32 x 16 = 512 programs, ~4 per SM
    assert argmax_chunks(512, 128256, 132) == (2, 63 * BLOCK)
    assert argmax_chunks(528, 128256, 132) == (1, 126 * BLOCK)
    for rows, vocab in [(1, 1), (1, 10**6), (3, 5 * BLOCK + 1), (1000, 49152)]:
        chunks, cols = argmax_chunks(rows, vocab, 132)
        assert 1 <= chunks <= MAX_CHUNKS and cols % BLOCK == 0
        assert (chunks - 1) * cols < vocab <= chunks * cols
