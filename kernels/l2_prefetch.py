"""Prefetch a tensor's bytes from HBM into the GPU's L2 cache, without waiting for them.

    l2_prefetch(t, nbytes=None)   queue the first nbytes of t's storage (all of it by default) for L2

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import is_interpreter, require

__all__ = ["CHUNK_BYTES", "l2_prefetch", "l2_prefetch_supported"]

CHUNK_BYTES = 64 * 1024  # bytes per bulk prefetch (a multiple of 16)
_CHUNKS_PER_PROGRAM = 32  # one per thread of a one-warp program: 2 MiB a program
_ALIGN = 16  # the bulk prefetch's address and size granule


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Program p queues bytes [p * CHUNKS * CHUNK, (p + 1) * CHUNKS * CHUNK) of ptr's first nbytes (a
    multiple of 16, as ptr's address) for L2, one bulk prefetch of up to CHUNK bytes per lane."""
    offsets = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * CHUNK
    sizes = tl.minimum(tl.maximum(nbytes - offsets, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + offsets, sizes], dtype=tl.int32, is_pure=False, pack=1,
    )


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
