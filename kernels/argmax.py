"""Greedy decoding's argmax over the vocabulary, spread over the whole GPU.

    argmax_rows(logits [N, V] float32) -> [N] int64, exactly torch.argmax(logits, dim=-1)

A row of 128,256 float32 logits is 0.5 MB: read at HBM speed that is about 0.1 µs of bandwidth, but
one row reduced by a few blocks is latency-bound. Here two launches:

1. `(N, chunks)` programs each reduce `chunk` consecutive columns of one row to its largest value's
   first index (chunks chosen so that about 4 programs per multiprocessor run at batch 1);
2. one program per row reduces its chunks' partials, in column order, to the row's first index.

Both kernels compile once per device whatever the shapes (their integer arguments are not
specialized, the merge always reads MAX_CHUNKS slots): `warm_up` compiles them at start-up.

Same answer as torch.argmax, bit for bit, ties and special values included: every float32 is
compared through an int32 key in the float order (x >= 0: its bits; x < 0: its bits with the 31
magnitude bits flipped), -0.0 keyed as +0.0 (they compare equal, so the first wins), and every NaN
keyed above +inf (torch.argmax returns the first NaN of a row holding one). Ties keep the lowest
column: within a tile the smallest index among the maxima, across tiles and chunks only a strictly
larger key replaces the best so far.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import (
    cdiv,
    check_inner_contiguous,
    check_tensor,
    is_interpreter,
    num_sms,
    require,
)
from sits.kernels.pdl import pdl_launch_options, pdl_wait

__all__ = ["KERNEL_MAX_ROWS", "argmax_chunks", "argmax_rows", "argmax_rows_reference", "kernel_is_faster", "warm_up"]

BLOCK = 1024  # columns per tile; a chunk is a whole number of tiles
MAX_CHUNKS = 256  # the second launch reduces at most this many partials per row in one tile
PROGRAMS_PER_SM = 4
INT32_MAX = 2**31 - 1
# Up to this many rows the kernel beats torch.argmax; past it torch's one-block-per-row reduction wins.
# H200, 128,256 columns (bench_argmax.py, 2026-12-02): 6.6x at 1 row, 2.3x at 32, 0.57x at 256, 0.52x at 512.
KERNEL_MAX_ROWS = 32


def argmax_rows_reference(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1): [N, V] -> [N] int64."""
    return logits.argmax(dim=-1)


def kernel_is_faster(logits: torch.Tensor) -> bool:
    """Whether argmax_rows beats torch.argmax on these [N, V] logits: at most KERNEL_MAX_ROWS rows with
    contiguous columns (the kernel's layout)."""
    return logits.shape[0] <= KERNEL_MAX_ROWS and logits.stride(-1) == 1


def argmax_chunks(rows: int, vocab: int, sms: int) -> tuple[int, int]:
    """(chunks per row, columns per chunk): about PROGRAMS_PER_SM programs per multiprocessor over
    all rows, at least one tile per chunk, at most MAX_CHUNKS chunks."""
    tiles = cdiv(vocab, BLOCK)
    wanted = max(1, cdiv(PROGRAMS_PER_SM * sms, max(rows, 1)))
    chunks = max(1, min(wanted, tiles, MAX_CHUNKS))
    tiles_per_chunk = cdiv(tiles, chunks)
    return cdiv(tiles, tiles_per_chunk), tiles_per_chunk * BLOCK


@triton.jit
def _ordered_key(x):
    """int32 keys whose signed order is float32's (-0.0 as +0.0, NaN above +inf)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, 0x7FFFFFFF, key)


# One binary per kernel whatever the batch, vocabulary or chunk count (nothing compiles on live
# traffic once a first call, e.g. `warm_up`, has compiled it).
@triton.jit(do_not_specialize=["stride_row", "n_cols", "chunk_cols", "n_chunks"])
def _argmax_chunk_kernel(logits_ptr, key_ptr, index_ptr, stride_row, n_cols, chunk_cols, n_chunks,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    start = chunk * chunk_cols
    end = tl.minimum(start + chunk_cols, n_cols)
    best_key = tl.full((), -0x80000000, tl.int32)
    best_index = tl.full((), 0x7FFFFFFF, tl.int32)
    for tile in range(start, end, BLOCK):
        cols = tile + offs
        valid = cols < end
        x = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=0.0)
        key = tl.where(valid, _ordered_key(x), -0x80000000)
        tile_key = tl.max(key, axis=0)
        tile_index = tl.min(tl.where(valid & (key == tile_key), cols, 0x7FFFFFFF), axis=0)
        better = tile_key > best_key
        best_index = tl.where(better, tile_index, best_index)
        best_key = tl.where(better, tile_key, best_key)
    tl.store(key_ptr + row * n_chunks + chunk, best_key)
    tl.store(index_ptr + row * n_chunks + chunk, best_index)


@triton.jit(do_not_specialize=["n_chunks"])
def _argmax_merge_kernel(key_ptr, index_ptr, out_ptr, n_chunks, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    valid = offs < n_chunks
    key = tl.load(key_ptr + row * n_chunks + offs, mask=valid, other=-0x80000000)
    index = tl.load(index_ptr + row * n_chunks + offs, mask=valid, other=0x7FFFFFFF)
    top = tl.max(key, axis=0)
    first = tl.min(tl.where(valid & (key == top), index, 0x7FFFFFFF), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first index of each row's largest value, as torch.argmax(logits, dim=-1).

    Args:
        logits: [N, V] float32, rows contiguous (row stride free), V < 2**31.
        out: optional [N] int64 output.
    Returns:
        [N] int64 column indices.
    Raises:
        ValueError: not 2-D float32, V == 0, columns not contiguous, or a wrong `out`.
    """
    check_tensor(logits, "logits", ndim=2, dtypes=(torch.float32,))
    rows, vocab = logits.shape
    require(vocab > 0, "logits must have at least one column")
    require(vocab < INT32_MAX, f"logits may have at most {INT32_MAX - 1} columns, got {vocab}")
    check_inner_contiguous(logits, "logits")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    require(out.shape == (rows,) and out.dtype == torch.int64 and out.device == logits.device,
            f"out must be a [{rows}] int64 tensor on {logits.device}")
    if rows == 0:
        return out
    sms = 8 if is_interpreter() else num_sms(logits.device)
    chunks, chunk_cols = argmax_chunks(rows, vocab, sms)
    keys = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    indices = torch.empty_like(keys)
    pdl = pdl_launch_options(logits.device)
    _argmax_chunk_kernel[(rows, chunks)](logits, keys, indices, logits.stride(0), vocab, chunk_cols, chunks,
                                         BLOCK=BLOCK, num_warps=4, **pdl)
    _argmax_merge_kernel[(rows,)](keys, indices, out, chunks, BLOCK_C=MAX_CHUNKS, num_warps=1, **pdl)
    return out


def warm_up(device: torch.device) -> None:
    """Compile both kernels for `device` now (at start-up), so no greedy step waits for a compile."""
    argmax_rows(torch.zeros(1, 1, dtype=torch.float32, device=device))
