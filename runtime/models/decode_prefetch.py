"""Bytes a small decode step reads later, queued for L2 beside its attention (SITS_DECODE_PREFETCH).

At batch 1 a Llama-3-8B layer's decode attention and o_proj leave HBM well under its rate for ~20 µs (attention
reads 8 MB in ~9 µs: its time is a chain of dependent steps in each program, not bytes), while the projections after
them read at the HBM roof (gate_up + SiLU·mul 235 MB in ~56 µs, down_proj, then the next layer's qkv_proj). Bytes
that depend on nothing the step computes can move into L2 in that window, from a stream beside it. What to queue is
SITS_DECODE_PREFETCH, comma-separated items:

- `gate_up=<bytes>`: the first bytes of each of this layer's gate_up weight rows (a multiple of 16; 512 is 14 MiB
  for Llama-3-8B's 28,672 rows). The small-M GEMM starts every program's K loop at column 0
  (sits.kernels.gemm_small_m), so every program then finds its first tiles in L2 and reads that much less from HBM
  (`l2_prefetch_rows`).
- `qkv=<bytes>`: the same for the next layer's qkv_proj (6,144 rows of 8 KB; 1,024 is 6 MiB), which runs on the
  same direct kernel at these batches.
- `kv`: the next layer's K / V pages, what its decode attention reads (8.4 MB at a 2,048-token context;
  `l2_prefetch_pages`). On an H200 (2026-12-05) that attention took 9.1 µs with its pages in L2 against 10.4 µs
  from HBM.

- `evict_last`: every prefetch above marks its lines to leave L2 after evict-normal ones (`createpolicy`
  `L2::evict_last`), so the weight streams in between pass them by.

What is queued must outlive other streams first: o_proj's 33.6 MB before gate_up, and this layer's gate_up and
down_proj (~350 MB) before the next layer's qkv_proj and attention. Hence `evict_last`, or SITS_WEIGHT_EVICT_FIRST=1
(kernels/gemm_small_m.py: the weight lines leave L2 first; with Triton 3.9 and later only, which carry the policy onto
the pipelined loads: not the H200 image's 3.6).

    prefetch = DecodePrefetch(PrefetchPlan(gate_up_row_bytes=512), max_tokens=4, device=device)
    prefetch.fork(gate_up_weight, next_qkv_weight, next_kv, block_tables, seq_lens)  # beside, after qkv_proj
    ...                                       # attention and o_proj on the current stream
    prefetch.join()                           # the current stream waits for it: gate_up next

A decode-only step with folded norms (`LlamaForCausalLM.forward_folded`) of at most `max_tokens` rows forks after
each layer's qkv_proj and joins before its gate_up; inside a CUDA graph that is a branch beside the attention. (A
step with prompt tokens never forks: a piecewise graph's pieces end at each attention, before the join.)
Correctness never depends on it: a prefetch changes no memory, and a line evicted again is read from HBM.

Off by default; only on a GPU that runs bulk L2 prefetches (sm_90 and later). Not yet timed in the decode step:
`STEPS="l2rows prof1 prof1-gup512 prof1-gup1024-el prof1-gup512-qkv1024-kv-el" benchmarks/gpu_profile_run.sh`
measures it (`-el`: evict_last).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from sits.kernels.l2_prefetch import l2_prefetch_pages, l2_prefetch_rows, l2_prefetch_supported

logger = logging.getLogger(__name__)

PREFETCH_ENV = "SITS_DECODE_PREFETCH"
PREFETCH_MAX_TOKENS = 4  # decode rows a step may have: past a few sequences their K / V reads fill HBM
_GRANULE = 16  # the bulk prefetch's size granule, bytes
_ROW_ITEMS = {"gate_up": "gate_up_row_bytes", "qkv": "qkv_row_bytes"}
_FLAG_ITEMS = {"kv": "kv_pages", "evict_last": "evict_last"}


@dataclass(frozen=True)
class PrefetchPlan:
    """What a layer queues beside its attention (see the module doc); all zero / False: nothing.

    Attributes:
        gate_up_row_bytes: bytes from the start of each of this layer's gate_up weight rows.
        qkv_row_bytes: bytes from the start of each of the next layer's qkv_proj weight rows.
        kv_pages: the next layer's K / V pages that the step's sequences fill.
        evict_last: the prefetched lines leave L2 after evict-normal ones.
    """

    gate_up_row_bytes: int = 0
    qkv_row_bytes: int = 0
    kv_pages: bool = False
    evict_last: bool = False

    def __bool__(self) -> bool:
        return bool(self.gate_up_row_bytes or self.qkv_row_bytes or self.kv_pages)

    def describe(self) -> str:
        parts = [f"gate_up's first {self.gate_up_row_bytes} bytes a row" if self.gate_up_row_bytes else "",
                 f"the next qkv_proj's first {self.qkv_row_bytes} bytes a row" if self.qkv_row_bytes else "",
                 "the next layer's K / V pages" if self.kv_pages else ""]
        described = ", ".join(filter(None, parts))
        return (described + (" (evict last)" if self.evict_last else "")) if described else "nothing"


def prefetch_plan() -> PrefetchPlan:
    """SITS_DECODE_PREFETCH's plan: `gate_up=<bytes>`, `qkv=<bytes>` (multiples of 16), `kv` and `evict_last`,
    comma-separated; unset or empty: nothing.

    Raises:
        ValueError: an item that is none of these, a size that is not a non-negative multiple of 16, or an item
            given twice.
    """
    value = os.environ.get(PREFETCH_ENV, "").strip()
    fields: dict[str, int | bool] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, _, size = item.partition("=")
        field = _FLAG_ITEMS.get(item) or _ROW_ITEMS.get(name)
        if field is None or (field in _ROW_ITEMS.values() and (not size.isdigit() or int(size) % _GRANULE)):
            raise ValueError(f"{PREFETCH_ENV}: {item!r} is not one of gate_up=<bytes>, qkv=<bytes> (non-negative "
                             f"multiples of {_GRANULE}), kv or evict_last")
        if field in fields:
            raise ValueError(f"{PREFETCH_ENV}: {name!r} is given twice")
        fields[field] = True if field in _FLAG_ITEMS.values() else int(size)
    return PrefetchPlan(**fields)


class DecodePrefetch:
    """The side stream and the plan (see the module doc); one per model."""

    def __init__(self, plan: PrefetchPlan, max_tokens: int, device: torch.device) -> None:
        self.plan, self.max_tokens = plan, max_tokens
        self.stream = torch.cuda.Stream(device)

    def applies(self, num_tokens: int) -> bool:
        """Whether a decode step of num_tokens rows prefetches."""
        return num_tokens <= self.max_tokens

    def fork(self, gate_up_weight: torch.Tensor, next_qkv_weight: torch.Tensor | None,
             next_kv: tuple[torch.Tensor, torch.Tensor] | None, block_tables: torch.Tensor,
             seq_lens: torch.Tensor) -> None:
        """Queue what the plan names on the side stream, after the current stream's work so far: this layer's
        gate_up_weight row prefixes, the next layer's next_qkv_weight row prefixes and next_kv's pages that the
        step's sequences fill (block_tables [num_seqs, width] and seq_lens [num_seqs] int32, the step's
        AttentionMetadata's); next_* None after the last layer."""
        plan = self.plan
        self.stream.wait_stream(torch.cuda.current_stream(gate_up_weight.device))
        with torch.cuda.stream(self.stream):
            if plan.gate_up_row_bytes:
                l2_prefetch_rows(gate_up_weight, plan.gate_up_row_bytes, plan.evict_last)
            if plan.qkv_row_bytes and next_qkv_weight is not None:
                l2_prefetch_rows(next_qkv_weight, plan.qkv_row_bytes, plan.evict_last)
            if plan.kv_pages and next_kv is not None:
                l2_prefetch_pages(next_kv[0], next_kv[1], block_tables, seq_lens, plan.evict_last)

    def join(self) -> None:
        """Make the current stream wait for the prefetch forked last (it must join before a graph's capture ends)."""
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def attach_decode_prefetch(model: nn.Module, kv_caches: list, device: torch.device) -> DecodePrefetch | None:
    """Give `model` (a LlamaForCausalLM whose decode steps fold the norms) its DecodePrefetch when
    SITS_DECODE_PREFETCH asks for one and `device` runs bulk L2 prefetches; at start-up, before the CUDA graphs are
    captured. The prefetch kernels are compiled here on the model's weights and the runner's caches (`kv_caches`,
    one (k_cache, v_cache) a layer), so no step compiles them. Returns it, or None.

    Raises:
        ValueError: a malformed SITS_DECODE_PREFETCH (`prefetch_plan`).
    """
    plan = prefetch_plan()
    if not plan or not getattr(model, "fold_buckets", None) or not l2_prefetch_supported(device):
        return None
    prefetch = DecodePrefetch(plan, PREFETCH_MAX_TOKENS, device)
    layer = model.model.layers[0]
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)  # one sequence of 0 tokens: nothing is read
    prefetch.fork(layer.mlp.gate_up_proj.weight, layer.self_attn.qkv_proj.weight, kv_caches[0] if kv_caches else None,
                  tables, tables.view(1))
    prefetch.join()
    torch.cuda.synchronize(device)
    model.decode_prefetch = prefetch
    logger.info("prefetched into L2 beside the attention of decode steps of at most %d rows: %s", PREFETCH_MAX_TOKENS,
                plan.describe())
    return prefetch
