"""Prefetch a tensor's bytes from HBM into the GPU's L2 cache, without waiting for them.

    l2_prefetch(t, nbytes=None)   queue the first nbytes of t's storage (all of it by default) for L2
    l2_prefetch_rows(w, row_bytes) queue the first row_bytes of every row of a 2-D w [N, K] for L2

At batch 1 a decode step's small kernels (the norms, RoPE + KV write, decode attention and its merge) leave
HBM mostly idle for ~15 µs a layer: attention reads 8 MiB of K/V at ~1 TB/s, the others almost nothing. A
projection's weight does not depend on anything a step computes, so its bytes can start moving into L2
while those kernels run; the projection then reads them from L2 instead of HBM.

Each program issues bulk prefetches (`cp.async.bulk.prefetch.L2.global`, sm_90: a hint; no completion is
tracked) of CHUNK_BYTES each, one per thread of its single warp. The hope was a launch that costs what a launch
costs, the copies going on beside the kernels that follow; the H200 says otherwise (below). Correctness never
depends on it: a prefetched line that was evicted again is read from
HBM as before. On a device without bulk prefetches (before sm_90, Triton's interpreter) it does nothing.

Measured on an H200 (2026-12-03, benchmarks/bench_l2_prefetch.py): the engine does not call it. Queued on the
decode stream, the 32 MiB o_proj prefetch launch took 10 µs (the grid does not retire before its bulk
prefetches have landed), while the o_proj it warms went from 12.1 µs (cold) to at best 8.2 µs (hot): attention
+ o_proj went from 20.7 to 32.0 µs, and norm + qkv_proj from 18.3 to 27.2 µs with an 8 MiB prefetch. The
launch beside the stream was measured too (2026-12-04: a second stream in the CUDA graph, forked before the
attention and joined before or after o_proj). That chain took 25.5 µs against 22.9 without the prefetch. On that
machine o_proj was barely faster hot than cold (13.2 against 14.1 µs), so there was little for the prefetch to win.

`l2_prefetch_rows` (each weight row's first bytes: every program of a GEMM that starts its K loop at column 0 gets
its first tiles from L2) was built for a stream beside the batch-1 attention, aimed at gate_up + SiLU·mul (235 MB
at the HBM roof). Measured on an H100
(2026-12-05, `bench_l2_prefetch.py --quick`): gate_up after 14-56 MiB of its row prefixes had landed took 77.8-78.2
µs against 78.8 cold, while the prefetch beside attention + o_proj + gate_up made that chain 7-8 µs slower
(103.6 -> 110.7-112.4 µs; evict-last lines, 112.0). The engine does not call it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import is_interpreter, require

__all__ = ["CHUNK_BYTES", "l2_prefetch", "l2_prefetch_rows", "l2_prefetch_supported"]

CHUNK_BYTES = 64 * 1024  # bytes per bulk prefetch (a multiple of 16)
_CHUNKS_PER_PROGRAM = 32  # one per thread of a one-warp program: 2 MiB a program
_ALIGN = 16  # the bulk prefetch's address and size granule
_ROWS_PER_PROGRAM = 256  # l2_prefetch_rows: rows a program queues, one bulk prefetch each


_PREFETCH = tl.constexpr(
    "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")
_PREFETCH_EVICT_LAST = tl.constexpr(
    "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
    "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }")


@triton.jit
def _bulk_prefetch(addresses, sizes, EVICT_LAST: tl.constexpr):
    """One bulk L2 prefetch per element: sizes[i] bytes (a multiple of 16; <= 0: none) from addresses[i]; with
    EVICT_LAST the lines are marked to leave L2 after evict-normal and evict-first ones."""
    if EVICT_LAST:
        tl.inline_asm_elementwise(_PREFETCH_EVICT_LAST, "=r,l,r", [addresses, sizes], dtype=tl.int32, is_pure=False,
                                  pack=1)
    else:
        tl.inline_asm_elementwise(_PREFETCH, "=r,l,r", [addresses, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Program p queues bytes [p * CHUNKS * CHUNK, (p + 1) * CHUNKS * CHUNK) of ptr's first nbytes (a
    multiple of 16, as ptr's address) for L2, one bulk prefetch of up to CHUNK bytes per lane."""
    offsets = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * CHUNK
    sizes = tl.minimum(tl.maximum(nbytes - offsets, 0), CHUNK).to(tl.int32)
    _bulk_prefetch(ptr + offsets, sizes, False)


@triton.jit
def _l2_prefetch_rows_kernel(ptr, rows, row_stride, nbytes, ROWS: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Program p queues bytes [0, nbytes) of rows p * ROWS .. + ROWS of ptr (row r at r * row_stride bytes;
    both 16-byte multiples) for L2, one bulk prefetch per row."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    sizes = tl.where(r < rows, nbytes, 0).to(tl.int32)
    offsets = tl.minimum(r, rows - 1).to(tl.int64) * row_stride
    _bulk_prefetch(ptr + offsets, sizes, EVICT_LAST)


def l2_prefetch_supported(device: torch.device) -> bool:
    """Whether `device` runs bulk L2 prefetches: a CUDA GPU of sm_90 or later, not Triton's interpreter."""
    if is_interpreter() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None) -> None:
    """Queue t's first `nbytes` bytes (rounded down to 16; all of t by default) for the L2 cache.

    Args:
        t: a contiguous tensor on a CUDA device (typically a weight the next kernels will read).
        nbytes: how many of its bytes, from its first; None for all of them.
    Raises:
        ValueError: t is not contiguous, or nbytes is negative or past t's size.
    A no-op where `l2_prefetch_supported` is false. Capturable in CUDA graphs (one kernel node).
    """
    require(t.is_contiguous(), "l2_prefetch needs a contiguous tensor")
    total = t.numel() * t.element_size()
    nbytes = total if nbytes is None else int(nbytes)
    require(0 <= nbytes <= total, f"nbytes must be in [0, {total}], got {nbytes}")
    if not l2_prefetch_supported(t.device):
        return
    skip = -t.data_ptr() % _ALIGN  # the bulk prefetch wants a 16-byte-aligned address
    nbytes = (nbytes - skip) // _ALIGN * _ALIGN if nbytes > skip else 0
    if nbytes == 0:
        return
    base = t.view(-1).view(torch.uint8)[skip:]
    grid = (triton.cdiv(nbytes, CHUNK_BYTES * _CHUNKS_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](base, nbytes, CHUNK=CHUNK_BYTES, CHUNKS=_CHUNKS_PER_PROGRAM, num_warps=1)


def l2_prefetch_rows(w: torch.Tensor, row_bytes: int, evict_last: bool = False) -> None:
    """Queue the first `row_bytes` bytes of every row of w (rounded down to 16; at most a row) for the L2 cache.

    A GEMM that streams each weight row from its first column (sits.kernels.gemm_small_m: every program runs
    K from 0) then finds the start of every program's K loop in L2: the prefetch takes the same share of
    HBM bytes off every program, where a prefix of the storage (`l2_prefetch`) would only spare the first
    programs theirs.

    Args:
        w: [N, K] on a CUDA device, its rows contiguous (stride(1) == 1), its address and row stride in
            bytes multiples of 16 (as an allocated weight's are).
        row_bytes: bytes from the start of each row, >= 0.
        evict_last: mark the lines to leave L2 after evict-normal and evict-first ones (`createpolicy`
            `L2::evict_last` on the prefetch), so streams of other data pass them by.
    Raises:
        ValueError: w is not 2-D with contiguous rows, its address or row stride is not 16-byte aligned,
            or row_bytes is negative.
    A no-op where `l2_prefetch_supported` is false. Capturable in CUDA graphs (one kernel node).
    """
    require(w.dim() == 2 and w.stride(1) == 1, "l2_prefetch_rows needs a 2-D tensor with contiguous rows")
    stride = w.stride(0) * w.element_size()
    require(w.data_ptr() % _ALIGN == 0 and stride % _ALIGN == 0,
            "l2_prefetch_rows needs a 16-byte aligned address and row stride")
    require(row_bytes >= 0, f"row_bytes must be >= 0, got {row_bytes}")
    nbytes = min(int(row_bytes), w.shape[1] * w.element_size()) // _ALIGN * _ALIGN
    if nbytes == 0 or w.shape[0] == 0 or not l2_prefetch_supported(w.device):
        return
    grid = (triton.cdiv(w.shape[0], _ROWS_PER_PROGRAM),)
    _l2_prefetch_rows_kernel[grid](w.view(torch.uint8), w.shape[0], stride, nbytes, ROWS=_ROWS_PER_PROGRAM,
                                   EVICT_LAST=evict_last, num_warps=2)

