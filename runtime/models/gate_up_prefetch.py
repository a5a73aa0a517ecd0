"""gate_up's weight-row prefixes queued for L2 beside a small decode step's attention (SITS_GATE_UP_PREFETCH).

At batch 1 a Llama-3-8B layer's gate_up + SiLU·mul reads 235 MB, at the HBM roof (~56 µs on an H200), while
its decode attention and o_proj before it leave HBM well under its rate for ~20 µs (attention reads 8 MB in
~9 µs). gate_up's weight depends on nothing a step computes, so the first bytes of each of its rows can move
into L2 then. The small-M GEMM starts every program's K loop at column 0 (sits.kernels.gemm_small_m), so each
program then finds its first tiles in L2 and reads that much less from HBM (`l2_prefetch_rows`).

    prefetch = GateUpPrefetch(row_bytes=512, max_tokens=4, device)
    prefetch.fork(weight)   # on its own stream, after the work queued so far (the layer's qkv_proj)
    ...                     # attention and o_proj on the current stream
    prefetch.join()         # the current stream waits for it: gate_up next

A decode-only step with folded norms (`LlamaForCausalLM.forward_folded`) of at most `max_tokens` rows forks after
qkv_proj and joins before gate_up, in every layer; inside a CUDA graph that is a branch beside the attention. (A
step with prompt tokens never forks: a piecewise graph's pieces end at each attention, before the join.)
Correctness never depends on it: the prefetch changes no memory, and a line evicted again is read from HBM.

Off unless SITS_GATE_UP_PREFETCH gives the bytes a row (a positive multiple of 16, e.g. 512: 14 MiB for
Llama-3-8B's 28,672 rows); only on a GPU that runs bulk L2 prefetches (sm_90 and later). Not yet timed in
the decode step: `STEPS="l2rows prof1 prof1-gup512 prof1-gup1024-ef" benchmarks/gpu_profile_run.sh` measures it
(`-ef`: SITS_WEIGHT_EVICT_FIRST=1, the small-M GEMMs' weight lines leave L2 first, so o_proj's stream spares
the prefetched ones; kernels/gemm_small_m.py).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from sits.kernels.l2_prefetch import l2_prefetch_rows, l2_prefetch_supported

logger = logging.getLogger(__name__)

PREFETCH_ENV = "SITS_GATE_UP_PREFETCH"
PREFETCH_MAX_TOKENS = 4  # decode rows a step may have: past a few sequences their K / V reads fill HBM
_GRANULE = 16  # the bulk prefetch's size granule, bytes


class GateUpPrefetch:
    """The side stream and the bytes a row to prefetch (see the module doc); one per model."""

    def __init__(self, row_bytes: int, max_tokens: int, device: torch.device) -> None:
        self.row_bytes, self.max_tokens = row_bytes, max_tokens
        self.stream = torch.cuda.Stream(device)

    def applies(self, num_tokens: int) -> bool:
        """Whether a decode step of num_tokens rows prefetches."""
        return num_tokens <= self.max_tokens

    def fork(self, weight: torch.Tensor) -> None:
        """Queue weight's row prefixes on the side stream, after the current stream's work so far."""
        self.stream.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(self.stream):
            l2_prefetch_rows(weight, self.row_bytes)

    def join(self) -> None:
        """Make the current stream wait for the prefetch forked last (it must join before a graph's capture ends)."""
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def prefetch_row_bytes() -> int:
    """SITS_GATE_UP_PREFETCH's bytes a row: 0 when unset, empty or 0 (off).

    Raises:
        ValueError: a value that is not a non-negative multiple of 16.
    """
    value = os.environ.get(PREFETCH_ENV, "").strip()
    if not value:
        return 0
    if not value.isdigit() or int(value) % _GRANULE:
        raise ValueError(f"{PREFETCH_ENV} must be a non-negative multiple of {_GRANULE} (bytes a row), got {value!r}")
    return int(value)


def attach_gate_up_prefetch(model: nn.Module, device: torch.device) -> GateUpPrefetch | None:
    """Give `model` (a LlamaForCausalLM whose decode steps fold the norms) its GateUpPrefetch when
    SITS_GATE_UP_PREFETCH asks for one and `device` runs bulk L2 prefetches; at start-up, before the CUDA
    graphs are captured. The prefetch kernel is compiled here, so no step compiles it. Returns it, or None."""
    row_bytes = prefetch_row_bytes()
    if not row_bytes or not getattr(model, "fold_buckets", None) or not l2_prefetch_supported(device):
        return None
    prefetch = GateUpPrefetch(row_bytes, PREFETCH_MAX_TOKENS, device)
    prefetch.fork(model.model.layers[0].mlp.gate_up_proj.weight)
    prefetch.join()
    model.gate_up_prefetch = prefetch
    logger.info("gate_up's first %d bytes a row prefetched into L2 beside the attention at decode steps of at most "
                "%d rows", row_bytes, PREFETCH_MAX_TOKENS)
    return prefetch
