"""CUDA graphs for decode steps: the whole model forward captured once per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a captured graph launches them all
with one call, so the GPU never waits for Python. As nano-vllm does it:

* fixed batch sizes (1, 2, 4, 8, then steps of 8 up to 128 and of 16 beyond, up to max_num_seqs);
  a step of n decodes replays the smallest bucket >= n, its extra rows padded (slot -1: no cache
  write; seq_len 0: the attention kernel reads nothing and returns zeros);
* per batch size, one graph at each context bound the attention back end asks for
  (`decode_graph_bounds`: by default max_model_len alone); a step replays the graph of the smallest
  bound that holds its longest context, so its attention launches are planned for that bound;
* static input buffers sized for the largest bucket, the batch copied into them before a replay;
  the attention metadata of each graph is a set of fixed views of those buffers, with the block
  table as wide as max_model_len needs and max_seq_len fixed to the graph's bound, so every
  launch's grid is the same at capture and at replay;
* captured largest first into one shared memory pool; steps with prompt tokens replay the piecewise
  graphs instead (`piecewise_graphs.py`: attention eager between captured pieces) or run eagerly;
* sampling stays outside the graph.

Before capturing a graph, one eager forward with contexts of its bound's length runs at that batch size,
so Triton compiles and autotunes its kernels on realistic work (autotuning cannot run inside a capture).

`capture=False` keeps all of the above except the capture itself: the forward runs eagerly on the
static, padded buffers. It exists so CPU tests (Triton's interpreter) can check the padding and
buffer handling that the graphs replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.engine.model_input import ModelInput

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def decode_batch_sizes(max_num_seqs: int, largest: int | None = None) -> list[int]:
    """The buckets, ascending: 1, 2, 4, 8, 16, 24, ... 128, 144, ... up to min(max_num_seqs, largest).

    The cap itself is always a bucket, so every batch the scheduler can build has one.
    """
    cap = max(1, min(max_num_seqs, largest or max_num_seqs))
    sizes = [1, 2, 4] + list(range(8, 129, 8)) + list(range(144, cap + 1, 16))
    return sorted({size for size in sizes if size < cap} | {cap})


def smallest_bucket(sizes: list[int], count: int) -> int:
    """The smallest of the ascending `sizes` that holds `count` (rows, tokens); the caller checked it fits."""
    return sizes[bisect.bisect_left(sizes, count)]


class StaticInputs:
    """What a captured forward reads of a step's tokens: ids, positions and KV slots, [largest] int64 each on
    the device. `load` copies a step's first `count` rows in and pads the rest of its bucket with slot -1 (no
    cache write); the padding rows' ids and positions keep what an earlier step left, valid ids and positions
    whose results nothing reads."""

    def __init__(self, largest: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, count: int,
             size: int) -> None:
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(positions)
        self.slot_mapping[:count].copy_(slot_mapping)
        if size > count:
            self.pad(count, size)

    def pad(self, start: int, end: int) -> None:
        self.slot_mapping[start:end].fill_(-1)


class DecodeGraphs:
    """Captured decode forwards of one model over one KV cache.

    Args:
        model: the decoder (`forward(input_ids, positions, kv_caches, metadata) -> [T, H]`).
        kv_caches: the runner's caches (their storage must not move after capture).
        batch_sizes: the buckets (decode_batch_sizes).
        max_model_len: the longest context, in tokens (sets the block-table width).
        block_size: tokens per KV block.
        capture: False runs the static, padded batch eagerly instead of replaying graphs (tests).
        bounds_for: the context bounds (tokens) of a batch size's graphs, given (batch size, table width in
            tokens); each is rounded up to whole blocks and the width is always one. None: the width alone.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: KVCaches, batch_sizes: list[int], max_model_len: int,
                 block_size: int, capture: bool = True,
                 bounds_for: Callable[[int, int], list[int]] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(batch_sizes)
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.capture_enabled = capture
        device = kv_caches[0][0].device
        largest = self.batch_sizes[-1]
        self.inputs = StaticInputs(largest, device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        width = self.max_blocks * block_size
        self.bounds = {size: _whole_blocks(bounds_for(size, width) if bounds_for else [], width, block_size)
                       for size in self.batch_sizes}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (batch size, context bound)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    @property
    def largest(self) -> int:
        return self.batch_sizes[-1]

    def bucket(self, num_seqs: int) -> int:
        """The smallest captured batch size that holds num_seqs decodes."""
        return smallest_bucket(self.batch_sizes, num_seqs)

    def graph_key(self, num_seqs: int, max_seq_len: int) -> tuple[int, int]:
        """(batch size, context bound) of the graph that a step of num_seqs decodes replays, its longest context
        max_seq_len tokens: the smallest of each that holds it (the width holds every context can_run admits)."""
        size = self.bucket(num_seqs)
        bounds = self.bounds[size]
        return size, bounds[min(bisect.bisect_left(bounds, max_seq_len), len(bounds) - 1)]

    def can_run(self, model_input: ModelInput) -> bool:
        """A decode-only batch that fits the largest bucket and the block-table width."""
        metadata = model_input.metadata
        return (model_input.is_decode_only and 0 < metadata.num_decodes <= self.largest
                and metadata.block_tables.shape[1] <= self.max_blocks)

    def _metadata(self, size: int, max_seq_len: int, seq_lens_list: list[int] | None = None) -> AttentionMetadata:
        """Fixed views of the static buffers for a batch size, max_seq_len the graph's context bound."""
        return AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=size,
            slot_mapping=self.inputs.slot_mapping[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            max_query_len=1, max_seq_len=max_seq_len,
            seq_lens_list=seq_lens_list or [max_seq_len] * size, query_lens_list=[1] * size,
        )  # fmt: skip

    def _forward_static(self, size: int, bound: int, seq_lens_list: list[int] | None = None) -> torch.Tensor:
        return self.model(self.inputs.input_ids[:size], self.inputs.positions[:size], self.kv_caches,
                          self._metadata(size, bound, seq_lens_list))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every graph, the largest batch size first, into one memory pool."""
        if not self.capture_enabled:
            return
        start = time.perf_counter()
        num_blocks = self.kv_caches[0][0].shape[0]
        table_row = torch.arange(self.max_blocks, dtype=torch.int32, device=self.block_tables.device) % num_blocks
        for size in reversed(self.batch_sizes):
            for bound in reversed(self.bounds[size]):
                # Realistic work for the autotuners: every row a context of the bound's length, no cache writes.
                self.inputs.slot_mapping.fill_(-1)
                self.block_tables.copy_(table_row.expand_as(self.block_tables))
                self.seq_lens.fill_(bound)
                self._forward_static(size, bound)
                self.seq_lens.zero_()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[size, bound] = self._forward_static(size, bound)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size, bound] = graph
        torch.cuda.synchronize()
        bounded = {size: bounds for size, bounds in self.bounds.items() if len(bounds) > 1}
        logger.info("CUDA graphs: captured %d decode graphs for %d batch sizes (%s)%s in %.1f s", len(self.graphs),
                    len(self.batch_sizes), ", ".join(map(str, self.batch_sizes)),
                    f", context bounds {bounded[min(bounded)]} at sizes {sorted(bounded)}" if bounded else "",
                    time.perf_counter() - start)

    def run(self, model_input: ModelInput) -> torch.Tensor:
        """[num_decodes, hidden] hidden states of a decode-only batch (a view of the bucket's output)."""
        metadata = model_input.metadata
        count = metadata.num_decodes
        size, bound = self.graph_key(count, metadata.max_seq_len)
        width = metadata.block_tables.shape[1]
        self.inputs.load(model_input.input_ids, model_input.positions, metadata.slot_mapping, count, size)
        self.seq_lens[:count].copy_(metadata.seq_lens)
        self.block_tables[:count, :width].copy_(metadata.block_tables)
        if size > count:
            self.seq_lens[count:size].zero_()
        if (size, bound) in self.graphs:
            self.graphs[size, bound].replay()
            return self.outputs[size, bound][:count]
        return self._forward_static(size, bound, list(metadata.seq_lens_list) + [0] * (size - count))[:count]


def _whole_blocks(bounds: list[int], width: int, block_size: int) -> list[int]:
    """The bounds (tokens) rounded up to whole blocks, those under `width` ascending and once each, then width."""
    return sorted({-(-bound // block_size) * block_size for bound in bounds if 0 < bound < width} | {width})
