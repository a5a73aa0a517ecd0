"""NVTX ranges around the engine's phases (schedule, prefill, decode, sample), so Nsight traces read well.

On a machine without CUDA the ranges cost nothing: `nvtx_range` is then a plain no-op context.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch


@functools.cache
def _enabled() -> bool:
    return torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """Mark the enclosed host code as one named range on the CUDA timeline."""
    if not _enabled():
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
