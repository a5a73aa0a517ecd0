"""The Triton attention back end: the `sits.kernels` paged kernels behind the back-end contract.

    rope_and_cache_write  → kernels.rope_kv_write (RoPE on q and k, K/V into their slots, one launch)
    forward, prefill rows → kernels.attention_prefill.paged_prefill_attention (varlen, causal, GQA)
    forward, decode rows  → kernels.attention_decode.paged_decode_attention (flash-decoding)
    rope_write_attend     → prefill rows: rope_and_cache_write on them, then the prefill kernel; decode rows:
                            the decode kernel with their RoPE + KV write fused in (`DecodeRope`), one launch
    kernel_ops()          → fused RMSNorm (+ residual) and SiLU·mul kernels

The forward reads only device tensors and host integers that the runner fixes per captured
batch size (max_query_len, max_seq_len), never the host lists of the metadata and never syncs, so
a decode step can be captured in a CUDA graph. It runs on CUDA in float16 / bfloat16; on a CPU it
runs through Triton's interpreter (TRITON_INTERPRET=1, float16 only: the interpreter's bfloat16
arithmetic is broken) when asked for by name, which is how CPU tests check it against the torch
back end.

An fp8 (e4m3) cache goes to the same kernels with its per-KV-head scales. The interpreter's
float32 -> fp8 cast is broken (it loses the exponent carry), so on a CPU the cache write of an fp8
cache is the torch back end's (the kernel still rotates q and k); the attention kernels read fp8 there.

With the fused merge on (`attention_decode.FUSED_MERGE_DEFAULT`, or SITS_DECODE_FUSED_MERGE=1 / 0 to
measure both ways), decode launches get the back end's split counters (`SplitCounters`, one zeroed int32
buffer per device) and merge their split-KV partials inside the split kernel: one launch per layer
instead of two at small batches.

With the fused RoPE on (`attention_decode.FUSED_ROPE_DEFAULT`, or SITS_DECODE_FUSED_ROPE=1 / 0 to measure
both ways), `rope_write_attend` rotates and writes the decode rows' q, k and v inside the decode kernel
instead of in a launch of its own before it: at decode that is one launch a layer fewer, the same bits for
power-of-two query groups (both kernels rotate through `rope_kv_write.rope_pair`; the kernel runs the
schedule tuned for the unfused launch). It is on by default (docs/engine-process.md gives the measurements);
on a CPU with an fp8 cache (the interpreter's fp8 cast) it is rope_and_cache_write then forward.

With context-bounded decode graphs on (`GRAPH_BOUNDS_DEFAULT`, or SITS_DECODE_GRAPH_BOUNDS=1 / 0 to measure both
ways), the decode graphs of a batch size whose launches split contexts are captured at several context bounds
(`decode_splits.graph_context_bounds`: 4,096 tokens, x4, ... up to max_model_len), each launch planned for its
bound, and a step replays the smallest that holds its longest context: a short context under a long max_model_len
then runs the split count, merge and schedule of its own bound instead of max_model_len's.
"""

from __future__ import annotations

import os

import torch

# The kernels import triton: on a machine without it this module raises ImportError, which the
# registry logs and skips.
from sits.kernels import attention_decode
from sits.kernels.attention_decode import paged_decode_attention
from sits.kernels.attention_prefill import paged_prefill_attention
from sits.kernels.decode_rope import DecodeRope
from sits.kernels.decode_splits import graph_context_bounds
from sits.kernels.rope_kv_write import rope_and_cache_write
from sits.runtime.attention.backend import AttentionBackend, AttentionMetadata
from sits.runtime.attention.registry import register_backend
from sits.runtime.attention.split_counters import SplitCounters
from sits.runtime.attention.torch_ref import write_kv_cache
from sits.runtime.env_switch import env_switch
from sits.runtime.models.kernel_ops import KernelOps, TritonKernelOps

_TRITON_OPS = TritonKernelOps()
HEAD_DIMS = (16, 32, 64, 128, 256)  # the paged kernels' tl.arange over a head needs a power of two


FUSED_MERGE_ENV = "SITS_DECODE_FUSED_MERGE"
FUSED_ROPE_ENV = "SITS_DECODE_FUSED_ROPE"
GRAPH_BOUNDS_ENV = "SITS_DECODE_GRAPH_BOUNDS"
# Whether decode CUDA graphs of batch sizes that split contexts are captured at several context bounds
# (decode_graph_bounds) instead of at max_model_len alone. Off until timed on an H200: with max_model_len
# 131,072 a batch-1 step over a 2,048-token context took 4.417 ms against 4.28-4.33 ms with the graphs sized for
# the run (2026-12-05, other machines; benchmarks/RESULTS.md); `prof1-mml131072-gb1` measures it.
GRAPH_BOUNDS_DEFAULT = False


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fused_merge_env() -> bool | None:
    """SITS_DECODE_FUSED_MERGE=1 / 0 (a benchmark measuring both ways): whether decode launches merge inside
    the split kernel whatever attention_decode.FUSED_MERGE_DEFAULT says; None when unset."""
    return env_switch(FUSED_MERGE_ENV)


def graph_bounds_env() -> bool | None:
    """SITS_DECODE_GRAPH_BOUNDS=1 / 0 (a benchmark measuring both ways): whether decode graphs are captured at
    several context bounds whatever GRAPH_BOUNDS_DEFAULT says; None when unset."""
    return env_switch(GRAPH_BOUNDS_ENV)


def fused_rope_env() -> bool | None:
    """SITS_DECODE_FUSED_ROPE=1 / 0 (a benchmark measuring both ways): whether decode rows get their RoPE + KV
    write inside the decode kernel whatever attention_decode.FUSED_ROPE_DEFAULT says; None when unset."""
    return env_switch(FUSED_ROPE_ENV)


@register_backend
class TritonAttentionBackend(AttentionBackend):
    """Paged attention, fused RoPE + KV write and the model's element-wise ops as Triton kernels."""

    name = "triton"
    version = "1"
    priority = 10  # ahead of the torch reference wherever it can run
    devices = ("cuda", "cpu")
    dtypes = (torch.float16, torch.bfloat16)
    head_dims = HEAD_DIMS
    supports_cuda_graphs = True
    supports_piecewise_graphs = True
    fp8_kv_cache = True

    def __init__(self) -> None:
        self.split_counters = SplitCounters()
        self._fused_merge_env = fused_merge_env()  # read once, not per launch
        self._fused_rope_env = fused_rope_env()
        self._graph_bounds_env = graph_bounds_env()

    @property
    def fused_merge(self) -> bool:
        """Whether decode launches get the split counters (the environment's choice, else the default)."""
        env = self._fused_merge_env
        return attention_decode.FUSED_MERGE_DEFAULT if env is None else env

    @property
    def fused_rope(self) -> bool:
        """Whether rope_write_attend fuses the decode rows' RoPE + KV write into the decode kernel (the
        environment's choice, else the default)."""
        env = self._fused_rope_env
        return attention_decode.FUSED_ROPE_DEFAULT if env is None else env

    @property
    def graph_bounds(self) -> bool:
        """Whether decode graphs get context bounds below max_model_len (the environment's choice, else the
        default)."""
        env = self._graph_bounds_env
        return GRAPH_BOUNDS_DEFAULT if env is None else env

    def decode_graph_bounds(self, num_seqs: int, width: int, num_kv_heads: int, device: torch.device) -> list[int]:
        """See AttentionBackend.decode_graph_bounds: `graph_context_bounds` on the device's multiprocessors (as
        the decode launches count them) when graph_bounds is on, else [width]."""
        if not self.graph_bounds:
            return [width]
        return graph_context_bounds(num_seqs, num_kv_heads, width, attention_decode.num_sms(device))

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        reason = super().unsupported_reason(device, dtype, head_dim)
        if reason is not None:
            return reason
        if device.type == "cuda" and not torch.cuda.is_available():
            return "no CUDA device"
        if device.type == "cpu":
            if not _interpreter_on():
                return "on a CPU it needs Triton's interpreter (TRITON_INTERPRET=1)"
            if dtype != torch.float16:
                return "the Triton interpreter computes only float16 correctly (bfloat16 arithmetic is broken there)"
        return None

    @classmethod
    def auto_unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if device.type == "cpu":
            return "the CPU interpreter is a debugging aid: ask for --attention-backend triton by name"
        return cls.unsupported_reason(device, dtype, head_dim)

    def kernel_ops(self) -> KernelOps:
        return _TRITON_OPS

    def rope_and_cache_write(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                             k_scale=None, v_scale=None):
        """See AttentionBackend.rope_and_cache_write; rotates q and k in place."""
        if k_scale is not None and q.device.type == "cpu":  # the interpreter's fp8 cast is wrong: rotate only
            no_slots = torch.full_like(slot_mapping, -1)
            rope_and_cache_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, no_slots, k_scale, v_scale)
            write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return q, k
        return rope_and_cache_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                    k_scale, v_scale)

    def forward(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                k_scale=None, v_scale=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """See AttentionBackend.forward. Prefill rows and decode rows each go to their kernel.

        k and v are not read: rope_and_cache_write put them in the cache, which both kernels read
        (piecewise CUDA graphs pass None). out: an optional [num_tokens, heads, head_dim] buffer in q's
        dtype, written in place (the static buffer a captured piece reads). Rows past
        metadata.num_tokens (padding) are left as they were.
        """
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._prefill(q, k_cache, v_cache, metadata, scale, out, k_scale, v_scale)
        self._decode(q, k_cache, v_cache, metadata, scale, out, k_scale, v_scale)
        return out

    def rope_write_attend(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, metadata: AttentionMetadata,
                          scale: float, **scales) -> torch.Tensor:
        """See AttentionBackend.rope_write_attend. With fused_rope: the prefill rows' RoPE + KV write
        (rope_and_cache_write on their slice) and the prefill kernel, then the decode kernel with the
        decode rows' RoPE + KV write inside it (q, k and v of those rows stay unrotated in memory).
        Without it, or on a CPU with an fp8 cache, the default: rope_and_cache_write, then forward."""
        if not self.fused_rope or not metadata.num_decodes or (scales and q.device.type == "cpu"):
            return super().rope_write_attend(q, k, v, positions, cos_sin_cache, k_cache, v_cache, metadata, scale,
                                             **scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        prefill = slice(0, metadata.num_prefill_tokens)
        if metadata.num_prefills:
            self.rope_and_cache_write(q[prefill], k[prefill], v[prefill], positions[prefill], cos_sin_cache,
                                      k_cache, v_cache, metadata.slot_mapping[prefill], **scales)
            self._prefill(q, k_cache, v_cache, metadata, scale, out, **scales)
        rows = slice(metadata.num_prefill_tokens, metadata.num_tokens)
        rope = DecodeRope(k[rows], v[rows], positions[rows], cos_sin_cache, metadata.slot_mapping[rows])
        self._decode(q, k_cache, v_cache, metadata, scale, out, rope=rope, **scales)
        return out

    def _prefill(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                 k_scale=None, v_scale=None) -> None:
        """The prefill rows (0 .. num_prefill_tokens) of q [num_tokens, Hq, D] into the same rows of out."""
        prefills, prefill_tokens = metadata.num_prefills, metadata.num_prefill_tokens
        if prefills:
            paged_prefill_attention(
                q[:prefill_tokens], k_cache, v_cache,
                metadata.query_start_loc[: prefills + 1], metadata.seq_lens[:prefills],
                metadata.block_tables[:prefills], scale, metadata.max_query_len,
                out=out[:prefill_tokens], k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip

    def _decode(self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                k_scale=None, v_scale=None, rope: DecodeRope | None = None) -> None:
        """The decode rows (after the prefill tokens) of q into the same rows of out; rope: their RoPE + KV
        write fused into the kernel (q unrotated), None when rope_and_cache_write ran."""
        if not metadata.num_decodes:
            return
        prefills = metadata.num_prefills
        rows = slice(metadata.num_prefill_tokens, metadata.num_tokens)
        counters = None
        if self.fused_merge:
            counters = self.split_counters.get(q.device, metadata.num_decodes, k_cache.shape[2])
        paged_decode_attention(
            q[rows], k_cache, v_cache,
            metadata.block_tables[prefills: prefills + metadata.num_decodes],
            metadata.seq_lens[prefills: prefills + metadata.num_decodes], scale,
            out=out[rows], max_seq_len=metadata.max_seq_len, k_scale=k_scale, v_scale=v_scale,
            split_counters=counters, rope=rope,
        )  # fmt: skip
