"""Bytes a small decode step reads later, queued for L2 beside its attention (SITS_GATE_UP_PREFETCH, SITS_KV_PREFETCH).

At batch 1 a Llama-3-8B layer's decode attention and o_proj leave HBM well under its rate for ~20 µs (attention
reads 8 MB in ~9 µs: its time is a chain of dependent steps in each program, not bytes), while gate_up + SiLU·mul
right after them reads 235 MB at the HBM roof (~56 µs). Bytes that depend on nothing the step computes can move
into L2 in that window, from a stream beside it:

- gate_up's weight-row prefixes (SITS_GATE_UP_PREFETCH=<bytes a row>, a multiple of 16, e.g. 512: 14 MiB for
  Llama-3-8B's 28,672 rows). The small-M GEMM starts every program's K loop at column 0 (sits.kernels.gemm_small_m),
  so every program then finds its first tiles in L2 and reads that much less from HBM (`l2_prefetch_rows`).
- the next layer's K / V pages (SITS_KV_PREFETCH=1): what that layer's decode attention reads, 8.4 MB at a
  2,048-token context (`l2_prefetch_pages`). On an H200 (2026-12-05) that attention took 9.1 µs with its pages
  in L2 against 10.4 from HBM. They must outlive ~400 MB of weight streams first (gate_up, down_proj, the next
  qkv_proj), so this pairs with SITS_WEIGHT_EVICT_FIRST=1 (kernels/gemm_small_m.py: weight lines leave L2 first).

    prefetch = DecodePrefetch(row_bytes=512, kv_pages=True, max_tokens=4, device)
    prefetch.fork(weight, next_kv, block_tables, seq_lens)  # on its own stream, after the qkv_proj
    ...                                                     # attention and o_proj on the current stream
    prefetch.join()                                         # the current stream waits for it: gate_up next

A decode-only step with folded norms (`LlamaForCausalLM.forward_folded`) of at most `max_tokens` rows forks after
each layer's qkv_proj and joins before its gate_up; inside a CUDA graph that is a branch beside the attention. (A
step with prompt tokens never forks: a piecewise graph's pieces end at each attention, before the join.)
Correctness never depends on it: a prefetch changes no memory, and a line evicted again is read from HBM.

Both are off by default and apply only on a GPU that runs bulk L2 prefetches (sm_90 and later). Not yet timed in
the decode step: `STEPS="l2rows prof1 prof1-gup512 prof1-gup1024-ef prof1-gup512-kv-ef" benchmarks/gpu_profile_run.sh`
measures them (`-ef`: SITS_WEIGHT_EVICT_FIRST=1; `-kv`: SITS_KV_PREFETCH=1).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from sits.kernels.l2_prefetch import l2_prefetch_pages, l2_prefetch_rows, l2_prefetch_supported

logger = logging.getLogger(__name__)

ROWS_ENV = "SITS_GATE_UP_PREFETCH"
KV_ENV = "SITS_KV_PREFETCH"
PREFETCH_MAX_TOKENS = 4  # decode rows a step may have: past a few sequences their K / V reads fill HBM
_GRANULE = 16  # the bulk prefetch's size granule, bytes


class DecodePrefetch:
    """The side stream, the bytes a gate_up row to prefetch and whether to prefetch the next layer's K / V pages
    (see the module doc); one per model."""

    def __init__(self, row_bytes: int, kv_pages: bool, max_tokens: int, device: torch.device) -> None:
        self.row_bytes, self.kv_pages, self.max_tokens = row_bytes, kv_pages, max_tokens
        self.stream = torch.cuda.Stream(device)

    def applies(self, num_tokens: int) -> bool:
        """Whether a decode step of num_tokens rows prefetches."""
        return num_tokens <= self.max_tokens

    def fork(self, gate_up_weight: torch.Tensor, next_kv: tuple[torch.Tensor, torch.Tensor] | None,
             block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Queue gate_up_weight's row prefixes, and next_kv's pages that the step's sequences fill (block_tables
        [num_seqs, width] and seq_lens [num_seqs] int32, the step's AttentionMetadata's; next_kv None: the last
        layer), on the side stream, after the current stream's work so far."""
        self.stream.wait_stream(torch.cuda.current_stream(gate_up_weight.device))
        with torch.cuda.stream(self.stream):
            if self.row_bytes:
                l2_prefetch_rows(gate_up_weight, self.row_bytes)
            if self.kv_pages and next_kv is not None:
                l2_prefetch_pages(next_kv[0], next_kv[1], block_tables, seq_lens)

    def join(self) -> None:
        """Make the current stream wait for the prefetch forked last (it must join before a graph's capture ends)."""
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def prefetch_row_bytes() -> int:
    """SITS_GATE_UP_PREFETCH's bytes a row: 0 when unset, empty or 0 (off).

    Raises:
        ValueError: a value that is not a non-negative multiple of 16.
    """
    value = os.environ.get(ROWS_ENV, "").strip()
    if not value:
        return 0
    if not value.isdigit() or int(value) % _GRANULE:
        raise ValueError(f"{ROWS_ENV} must be a non-negative multiple of {_GRANULE} (bytes a row), got {value!r}")
    return int(value)


def prefetch_kv_pages() -> bool:
    """Whether SITS_KV_PREFETCH asks for the next layer's K / V pages (1 / true / on / yes; unset, 0 / false /
    off / no: not).

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(KV_ENV, "").strip().lower()
    if value not in ("", "0", "false", "off", "no", "1", "true", "on", "yes"):
        raise ValueError(f"{KV_ENV} must be 1 or 0 (on or off), got {value!r}")
    return value in ("1", "true", "on", "yes")


def attach_decode_prefetch(model: nn.Module, kv_caches: list, device: torch.device) -> DecodePrefetch | None:
    """Give `model` (a LlamaForCausalLM whose decode steps fold the norms) its DecodePrefetch when
    SITS_GATE_UP_PREFETCH or SITS_KV_PREFETCH asks for one and `device` runs bulk L2 prefetches; at start-up,
    before the CUDA graphs are captured. The prefetch kernels are compiled here on the model's weight and the
    runner's caches (`kv_caches`, one (k_cache, v_cache) a layer), so no step compiles them. Returns it, or None."""
    row_bytes, kv_pages = prefetch_row_bytes(), prefetch_kv_pages()
    if not (row_bytes or kv_pages) or not getattr(model, "fold_buckets", None) or not l2_prefetch_supported(device):
        return None
    prefetch = DecodePrefetch(row_bytes, kv_pages and bool(kv_caches), PREFETCH_MAX_TOKENS, device)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)  # one sequence of 0 tokens: nothing is read
    prefetch.fork(model.model.layers[0].mlp.gate_up_proj.weight, kv_caches[0] if kv_caches else None, tables,
                  tables.view(1))
    prefetch.join()
    torch.cuda.synchronize(device)
    model.decode_prefetch = prefetch
    logger.info("prefetched into L2 beside the attention of decode steps of at most %d rows: %s", PREFETCH_MAX_TOKENS,
                ", ".join(filter(None, [f"gate_up's first {row_bytes} bytes a row" if row_bytes else "",
                                        "the next layer's K / V pages" if prefetch.kv_pages else ""])))
    return prefetch
