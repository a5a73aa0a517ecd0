"""Piecewise CUDA graphs for steps with prompt tokens: everything but attention, replayed.

A decode-only step replays one captured graph (`cuda_graphs.py`). A step that also computes prompt
tokens cannot: its attention launches depend on how many prefills it holds, their lengths and the
decode split, which change every step. Run eagerly, such a step's few hundred launches are paced by
the host: on the H200 at 256 streams a step with 768 prompt tokens took ~27 ms of Python to launch
~31 ms of GPU work (`benchmarks/profile_decode.py --mixed-prompt-tokens`), so mixed steps ran at the
host's speed and their time swung with it. vLLM's answer, which this follows, is piecewise graphs:

* the forward is cut at every attention call. Each piece between two attention calls (the o
  projection, the residual add + norm, the MLP, the next layer's norm, qkv projection and RoPE + KV
  write) is captured once per token-count bucket: 33 graphs for a 32-layer model;
* attention runs eagerly between the pieces, with the step's real metadata, reading its rotated
  queries from a static buffer the previous piece wrote (`q_static`, [max_tokens, heads, head_dim])
  and writing into the one the next piece reads (`out_static`); keys and values are already in the
  paged cache (the piece's RoPE + KV write put them there);
* a step of T tokens replays the smallest bucket >= T; its rows T.. are padding (slot -1: no cache
  write; ids and positions left from earlier steps), never read by attention (which sees only the first T rows)
  and sliced off the output. Rows are independent in every piece (GEMMs, norms, per-token
  quantization), so padding cannot change a real row;
* the inputs (token ids, positions, slots) live in static buffers, copied in before the replay;
* pieces are captured largest bucket first into one memory pool, each bucket after one eager run of
  the same static forward (Triton compiles, cuBLAS picks its kernels; attention is skipped there,
  it runs eagerly at replay anyway and the start-up pre-tune covered its keys).

So a mixed step launches 33 graphs and two attention kernels a layer instead of every kernel. Steps
larger than the largest bucket (a full prefill chunk) run eagerly: their GPU time dwarfs the launches.

`capture=False` runs the same static, padded forward with the same attention holes eagerly, so CPU
tests (Triton's interpreter) check the buffers, padding and holes the graphs replay.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sits.runtime.attention.backend import AttentionBackend, AttentionMetadata
from sits.runtime.engine.cuda_graphs import StaticInputs, smallest_bucket
from sits.runtime.engine.model_input import ModelInput

logger = logging.getLogger(__name__)

KVCaches = list[Any]


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """The buckets, ascending: 8, 16, 32, 64, then steps of 64 to 512 and of 128 beyond, up to
    max_tokens (itself always a bucket, so every step of at most max_tokens tokens has one)."""
    if max_tokens < 1:
        return []
    sizes = [8, 16, 32] + list(range(64, 513, 64)) + list(range(640, max_tokens + 1, 128))
    return sorted({size for size in sizes if size < max_tokens} | {max_tokens})


def _one_prefill(size: int, slot_mapping: torch.Tensor, block_table: torch.Tensor) -> AttentionMetadata:
    """The metadata of one prompt of `size` new tokens from position 0 (no cached prefix): slot_mapping [size]
    int64, block_table [1, blocks] int32, on the device."""
    device = slot_mapping.device
    return AttentionMetadata(
        num_prefills=1, num_prefill_tokens=size, num_decodes=0, slot_mapping=slot_mapping,
        query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([size], dtype=torch.int32, device=device), block_tables=block_table,
        max_query_len=size, max_seq_len=size, seq_lens_list=[size], query_lens_list=[size],
    )  # fmt: skip


@dataclass
class _Hole:
    """One attention call cut out of the captured forward: what it needs at replay besides the step's
    metadata (the layer's cache, its softmax scale, an fp8 cache's k_scale / v_scale keywords)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    scales: dict[str, torch.Tensor]


@dataclass
class _Pieces:
    """A bucket's captured graphs (one more than holes) and its output [bucket, hidden]."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    output: torch.Tensor | None = None


class _HoleBackend:
    """Stands in for the attention back end while the static forward runs: RoPE + KV write go to the
    real back end; `forward` copies the rotated queries into `q_static` and returns `out_static`'s
    rows, so the pieces on either side of it read and write fixed addresses.

    Modes: "warmup" (attention skipped: the eager pass before a capture), "capture" (the current graph
    ends at the hole and the next one begins), "eager" (attention computed on the spot over the
    static buffers: capture=False).
    """

    def __init__(self, owner: PiecewiseGraphs, backend, mode: str, metadata: AttentionMetadata | None = None,
                 num_tokens: int = 0) -> None:
        self._owner, self._backend, self._mode = owner, backend, mode
        self._metadata, self._num_tokens = metadata, num_tokens
        self.holes: list[_Hole] = []

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def rope_and_cache_write(self, *args, **kwargs):
        return self._backend.rope_and_cache_write(*args, **kwargs)

    # Unfused here, whatever the real back end fuses: RoPE + KV write stay in the captured piece and only
    # attention runs in the hole (`forward` below), so a piece never depends on the step's batch layout.
    rope_write_attend = AttentionBackend.rope_write_attend

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale, **scales):
        owner = self._owner
        rows = q.shape[0]
        q_static, out_static = owner.static_attention_buffers(q)
        q_static[:rows].copy_(q)
        hole = _Hole(k_cache, v_cache, scale, dict(scales))
        self.holes.append(hole)
        if self._mode == "capture":
            owner.next_piece()
        elif self._mode == "eager":
            owner.attend(hole, self._metadata, self._num_tokens)
        return out_static[:rows]


class PiecewiseGraphs:
    """Captured pieces of the forward of one model over one KV cache, per token-count bucket.

    Args:
        model: the decoder (`forward(input_ids, positions, kv_caches, metadata) -> [T, H]`), whose
            attention modules call `self.backend.rope_write_attend` once per layer (the Llama family's
            `LlamaAttention`), which the hole back end runs as `rope_and_cache_write` then `forward`.
        backend: the real attention back end (its `forward` takes `out=`).
        kv_caches: the runner's caches (their storage must not move after capture).
        token_sizes: the buckets (piecewise_token_sizes).
        capture: False runs the static, padded forward and its holes eagerly instead (tests).
    """

    def __init__(self, model: torch.nn.Module, backend, kv_caches: KVCaches, token_sizes: list[int],
                 capture: bool = True) -> None:
        if not token_sizes:
            raise ValueError("piecewise CUDA graphs need at least one token-count bucket")
        if not getattr(backend, "supports_piecewise_graphs", False):
            raise ValueError(f"the {getattr(backend, 'name', '?')} attention back end cannot run between graphs "
                             "(AttentionBackend.supports_piecewise_graphs)")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.token_sizes = sorted(token_sizes)
        self.capture_enabled = capture
        self.inputs = StaticInputs(self.token_sizes[-1], kv_caches[0][0].device)
        self.q_static: torch.Tensor | None = None  # [largest, heads, head_dim], made at the first hole
        self.out_static: torch.Tensor | None = None
        self.pieces: dict[int, _Pieces] = {}
        self.holes: list[_Hole] = []
        self.pool = None
        self._capturing: _Pieces | None = None

    @property
    def largest(self) -> int:
        """The largest bucket: the most tokens a step may have to replay the pieces."""
        return self.token_sizes[-1]

    def can_run(self, model_input: ModelInput) -> bool:
        return 0 < model_input.num_tokens <= self.largest

    # -- the static buffers and the holes ---------------------------------------------------------
    def static_attention_buffers(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_static, out_static), made on the first call with q's heads, head size and dtype."""
        if self.q_static is None:
            shape = (self.largest, q.shape[1], q.shape[2])
            self.q_static = torch.zeros(shape, dtype=q.dtype, device=q.device)
            self.out_static = torch.zeros(shape, dtype=q.dtype, device=q.device)
        assert self.out_static is not None
        return self.q_static, self.out_static

    def attend(self, hole: _Hole, metadata: AttentionMetadata, num_tokens: int) -> None:
        """One layer's attention over the step's first num_tokens rows of q_static, into out_static."""
        assert self.q_static is not None and self.out_static is not None
        self.backend.forward(self.q_static[:num_tokens], None, None, hole.k_cache, hole.v_cache, metadata,
                             hole.scale, out=self.out_static[:num_tokens], **hole.scales)

    def next_piece(self) -> None:
        """During a capture: end the current piece's graph and begin the next one."""
        pieces = self._capturing
        assert pieces is not None
        pieces.graphs[-1].capture_end()
        self._begin_graph(pieces)

    def _begin_graph(self, pieces: _Pieces) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        pieces.graphs.append(graph)

    @contextlib.contextmanager
    def _holes_in(self, hole_backend: _HoleBackend):
        """The model's attention modules call hole_backend instead of the real back end, for a while."""
        modules = [m for m in self.model.modules() if getattr(m, "backend", None) is self.backend
                   and m is not self.model]
        for module in modules:
            module.backend = hole_backend
        try:
            yield
        finally:
            for module in modules:
                module.backend = self.backend

    def _capture_metadata(self, size: int) -> AttentionMetadata:
        """What the pieces read of a step's metadata: only the slots of the KV write (the static
        buffer); the rest describes one prefill of `size` tokens and is never read there."""
        block_table = torch.zeros(1, 1, dtype=torch.int32, device=self.inputs.slot_mapping.device)
        return _one_prefill(size, self.inputs.slot_mapping[:size], block_table)

    def _forward_static(self, size: int, hole_backend: _HoleBackend, metadata: AttentionMetadata) -> torch.Tensor:
        """The model over the static buffers' first `size` rows, attention through `hole_backend`
        (`metadata`: _capture_metadata(size), made before a capture begins: it copies to the device)."""
        with self._holes_in(hole_backend):
            return self.model(self.inputs.input_ids[:size], self.inputs.positions[:size], self.kv_caches, metadata)

    # -- capture and replay -----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket's pieces, largest first, into one memory pool."""
        if not self.capture_enabled:
            return
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.token_sizes):
            self.inputs.pad(0, size)  # neither pass writes the cache
            metadata = self._capture_metadata(size)
            self._forward_static(size, _HoleBackend(self, self.backend, "warmup"), metadata)
            torch.cuda.synchronize()
            pieces = _Pieces()
            hole_backend = _HoleBackend(self, self.backend, "capture")
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._capturing = pieces
                try:
                    self._begin_graph(pieces)
                    pieces.output = self._forward_static(size, hole_backend, metadata)
                    pieces.graphs[-1].capture_end()
                except BaseException:
                    with contextlib.suppress(Exception):  # leave the stream out of capture mode, then report
                        pieces.graphs[-1].capture_end()
                    self.pieces.clear()
                    raise
                finally:
                    self._capturing = None
            torch.cuda.current_stream().wait_stream(stream)
            self.pieces[size] = pieces
            self.holes = hole_backend.holes  # the same layers' caches and scales in every bucket
        torch.cuda.synchronize()
        graphs = sum(len(p.graphs) for p in self.pieces.values())
        logger.info("piecewise CUDA graphs: %d pieces a step (attention between them) for steps of up to %d "
                    "tokens, %d buckets (%s), %d graphs in %.1f s", len(self.holes) + 1, self.largest,
                    len(self.pieces), ", ".join(map(str, self.token_sizes)), graphs, time.perf_counter() - start)

    def run(self, model_input: ModelInput) -> torch.Tensor:
        """[num_tokens, hidden] hidden states of the step (a view of the bucket's output)."""
        return self._replay(model_input.input_ids, model_input.positions, model_input.metadata,
                            model_input.num_tokens)

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                count: int) -> torch.Tensor:
        size = smallest_bucket(self.token_sizes, count)
        self.inputs.load(input_ids, positions, metadata.slot_mapping, count, size)
        pieces = self.pieces.get(size)
        if pieces is None:  # capture=False: the same static forward, attention computed at each hole
            hole_backend = _HoleBackend(self, self.backend, "eager", metadata, count)
            return self._forward_static(size, hole_backend, self._capture_metadata(size))[:count]
        for graph, hole in zip(pieces.graphs, self.holes, strict=False):
            graph.replay()
            self.attend(hole, metadata, count)
        pieces.graphs[-1].replay()
        assert pieces.output is not None
        return pieces.output[:count]

    @torch.inference_mode()
    def verify(self, vocab_size: int, seed: int = 0) -> dict[int, float]:
        """The replay against the eager forward, once, before serving: {bucket: max |difference| / max |eager|}.

        For the smallest and the largest bucket, one random prompt filling the bucket is run through the
        model eagerly and through the pieces, both writing its K/V to the cache's first blocks (zeroed
        again afterwards: nothing is cached before the first request) and attending over them, so a
        piece that read a wrong buffer, or a hole that attended over the wrong rows, shows as a large
        difference; the same kernels at the same shapes otherwise agree to rounding.
        """
        errors: dict[int, float] = {}
        k_cache = self.kv_caches[0][0]
        num_blocks, block_size = int(k_cache.shape[0]), int(k_cache.shape[1])
        generator = torch.Generator().manual_seed(seed)
        for size in sorted({self.token_sizes[0], self.largest}):
            blocks = -(-size // block_size)
            if blocks > num_blocks:
                continue
            device = self.inputs.input_ids.device
            ids = torch.randint(0, vocab_size, (size,), generator=generator).to(device)
            positions = torch.arange(size, dtype=torch.int64, device=device)
            metadata = _one_prefill(size, positions.clone(),
                                    torch.arange(blocks, dtype=torch.int32, device=device).unsqueeze(0))
            eager = self.model(ids, positions, self.kv_caches, metadata).float()
            replayed = self._replay(ids, positions, metadata, size).float()
            scale = eager.abs().max().clamp_min(1e-6)
            errors[size] = float((replayed - eager).abs().max() / scale)
            for layer_cache in self.kv_caches:
                layer_cache[0][:blocks].zero_()
                layer_cache[1][:blocks].zero_()
        return errors
