"""sits.kernels.l2_prefetch: a hint that never changes memory, refused on bad input, a no-op off sm_90."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.l2_prefetch import (
    CHUNK_BYTES,
    l2_prefetch,
    l2_prefetch_rows,
    l2_prefetch_supported,
)
from tests.kernels.helpers import DEVICE


def test_bad_input_is_refused():
    t = torch.zeros(64, 64, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(t.t())
    with pytest.raises(ValueError, match="nbytes must be in"):
        l2_prefetch(t, 64 * 64 * 4 + 16)
    with pytest.raises(ValueError, match="nbytes must be in"):
        l2_prefetch(t, -1)


def test_bad_input_to_the_row_prefetch_is_refused():
    w = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous rows"):
        l2_prefetch_rows(w.t(), 64)
    with pytest.raises(ValueError, match="contiguous rows"):
        l2_prefetch_rows(w.view(-1), 64)
    with pytest.raises(ValueError, match="aligned"):
        l2_prefetch_rows(w[:, 1:], 64)  # rows start 2 bytes in
    with pytest.raises(ValueError, match="aligned"):
        l2_prefetch_rows(torch.zeros(8, 12, dtype=torch.bfloat16, device=DEVICE), 16)  # 24-byte rows
    with pytest.raises(ValueError, match="row_bytes must be"):
        l2_prefetch_rows(w, -16)


def test_off_a_gpu_it_is_a_no_op():
    assert not l2_prefetch_supported(torch.device("cpu"))
    t = torch.arange(1000, dtype=torch.float32)
    l2_prefetch(t)
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32))
    w = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    l2_prefetch_rows(w, 64)
    assert torch.equal(w, torch.arange(64 * 32, dtype=torch.float32).view(64, 32))


def _leave_every_byte(tensors, eager, captured) -> None:
    """Run `eager` (a callable), then capture `captured` in a CUDA graph and replay it: every tensor keeps its bytes."""
    before = [t.clone() for t in tensors]
    eager()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("offset", [0, 1, 3], ids=["aligned", "offset-1", "offset-3"])
def test_prefetches_leave_every_byte_as_it_was_eager_and_in_a_cuda_graph(offset):
    """Several programs' worth of chunks, a tail that is not a whole chunk, a base address off the 16-byte
    granule (a bf16 view starting 1 or 3 elements in) and a prefix: nothing changes, in a graph too."""
    base = torch.randn(3 * 32 * CHUNK_BYTES // 2 + 1000, dtype=torch.bfloat16, device=DEVICE)
    view = base[offset:]

    def eager():
        l2_prefetch(view)
        l2_prefetch(view, 4096 + 6)
        l2_prefetch(view, 0)
    _leave_every_byte([base], eager, lambda: l2_prefetch(view))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU")
def test_row_prefetches_leave_every_byte_as_it_was_eager_and_in_a_cuda_graph():
    """More rows than a program queues (a partial last program), a row prefix not a multiple of 16 bytes, one
    longer than a row, rows of a wider tensor (a row stride past the row), lines marked evict-last: nothing
    changes."""
    base = torch.randn(600, 4096 + 64, dtype=torch.bfloat16, device=DEVICE)
    w = base[:, :4096]

    def eager():
        for row_bytes in (1000, 1 << 20, 0):
            l2_prefetch_rows(w, row_bytes)
        l2_prefetch_rows(w, 512, evict_last=True)

    def captured():
        l2_prefetch_rows(w, 512)
        l2_prefetch_rows(w, 256, evict_last=True)
    _leave_every_byte([base], eager, captured)

