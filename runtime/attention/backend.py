"""The attention back-end contract: what the model calls, and the batch metadata it passes.

The model runner builds one `AttentionMetadata` per step and hands it to the model explicitly
(never through module globals). A back end writes the new tokens' K/V into the paged cache and
attends over it, for a flat batch that holds prefill (and chunked-prefill) sequences first and
single-token decodes after them. The model calls `rope_write_attend` once per layer; by default that
is `rope_and_cache_write` then `forward`, and a back end may fuse the two (the Triton one does for
decode rows).

Paged KV cache layout, one pair per layer:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's slot is `block_id * block_size + offset`; slot -1 means "padding, do not write".

RoPE table layout (`cos_sin_cache`): [max_positions, rotary_dim] float32, cos in the first
rotary_dim / 2 columns and sin in the second half (rotate-half / NeoX style, as HF Llama uses).

Each back end declares what it supports (devices, dtypes, head sizes, cache layout, CUDA-graph
capture) and which version of this interface it implements (`interface_version`, "major.minor"):
the registry refuses a back end whose major version differs from INTERFACE_VERSION's, so a back
end written for another contract fails with a clear message instead of a wrong answer. A back end
may also bring the model's other hot ops (RMSNorm, SiLU·mul) through `kernel_ops()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sits.runtime.models.kernel_ops import TORCH_OPS, KernelOps

# The contract below, "major.minor". A major bump breaks back ends; a minor bump only adds.
# 1.2: an fp8 cache (fp8_kv_cache, k_scale / v_scale keywords); 1.3: rope_write_attend (a concrete default).
INTERFACE_VERSION = "1.3"
# The one cache layout the engine allocates: [num_blocks, block_size, num_kv_heads, head_dim].
PAGED_NHD = "paged-nhd"


@dataclass
class AttentionMetadata:
    """One step's flat batch, as the attention back end sees it.

    Sequences 0 .. num_prefills-1 run the prefill path (any number of new tokens, possibly after a
    cached prefix); sequences num_prefills .. num_seqs-1 are decodes with exactly one new token.

    Attributes:
        num_prefills: sequences on the prefill path.
        num_prefill_tokens: new tokens of those sequences (they come first in the flat batch).
        num_decodes: sequences on the decode path (one token each, after the prefill tokens).
        slot_mapping: [num_tokens] int64, cache slot for each new token's K/V; -1 = padding.
        query_start_loc: [num_seqs + 1] int32, cu_seqlens of the new tokens in the flat batch.
        seq_lens: [num_seqs] int32, tokens in each sequence's context after this step
            (cached prefix + new tokens). A new token at query index j of sequence i sits at
            position seq_lens[i] - query_len[i] + j and attends causally to positions <= its own.
        block_tables: [num_seqs, max_blocks_per_seq] int32, physical block ids, padded with 0.
        max_query_len: max new tokens of one sequence in this batch.
        max_seq_len: max of seq_lens.
        seq_lens_list, query_lens_list: the same on the host (the reference back end loops over them).
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    seq_lens_list: list[int]
    query_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes


class AttentionBackend(ABC):
    """Writes K/V into the paged cache and computes attention over it.

    Implementations declare what they support; the registry (`registry.py`) picks the best one
    available for a device, dtype and head size, and logs why.
    """

    name: ClassVar[str]
    version: ClassVar[str] = "1"  # the back end's own version (for the log)
    interface_version: ClassVar[str] = INTERFACE_VERSION  # the contract it implements
    priority: ClassVar[int] = 0  # higher wins when several back ends support a configuration
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    head_dims: ClassVar[tuple[int, ...] | None] = None  # None: any head size
    kv_layout: ClassVar[str] = PAGED_NHD
    # True when forward() reads only device tensors of fixed shape (never the host lists of the
    # metadata, never a host sync), so a decode step can be captured in a CUDA graph and replayed.
    supports_cuda_graphs: ClassVar[bool] = False
    # True when forward() reads only q and the caches (never its k and v arguments, which may be None)
    # and writes into an `out=` buffer when given one: steps with prompt tokens can then be captured
    # piecewise, attention running eagerly between graphs (`engine/piecewise_graphs.py`).
    supports_piecewise_graphs: ClassVar[bool] = False
    # True when the back end reads and writes a float8_e4m3fn cache: rope_and_cache_write and forward
    # then get `k_scale`, `v_scale` ([num_kv_heads] float32, value = stored * scale) as keywords.
    # Back ends without it are never called with those keywords.
    fp8_kv_cache: ClassVar[bool] = False

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """None when this back end can run the configuration, else a short reason for the log.

        The default checks the declared devices, dtypes, head sizes and cache layout; back ends
        with other conditions (a library, an environment) extend it.
        """
        if device.type not in cls.devices:
            return f"runs on {'/'.join(cls.devices)}, not {device.type}"
        if dtype not in cls.dtypes:
            return f"supports {', '.join(str(d).removeprefix('torch.') for d in cls.dtypes)}, not " + str(
                dtype
            ).removeprefix("torch.")
        if cls.head_dims is not None and head_dim not in cls.head_dims:
            return f"supports head_dim {', '.join(map(str, cls.head_dims))}, not {head_dim}"
        if cls.kv_layout != PAGED_NHD:
            return f"uses the {cls.kv_layout!r} cache layout; the engine allocates {PAGED_NHD!r}"
        return None

    @classmethod
    def auto_unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why `--attention-backend auto` should pass this back end over (default: unsupported_reason).

        A back end that can run a configuration only as a debugging aid (Triton's CPU interpreter)
        runs there when asked for by name, never by auto.
        """
        return cls.unsupported_reason(device, dtype, head_dim)

    @classmethod
    def describe(cls) -> str:
        """One line for the log: name, versions and what the back end declares."""
        dims = "any" if cls.head_dims is None else "/".join(map(str, cls.head_dims))
        dtypes = "/".join(str(d).removeprefix("torch.") for d in cls.dtypes)
        return (f"{cls.name} v{cls.version} (interface {cls.interface_version}; {'/'.join(cls.devices)}; "
                f"{dtypes}; head_dim {dims}; {cls.kv_layout}; cuda graphs {'yes' if cls.supports_cuda_graphs else 'no'})")

    def decode_graph_bounds(self, num_seqs: int, width: int, num_kv_heads: int, device: torch.device) -> list[int]:
        """The context bounds (tokens, ascending, the last one `width`) at which the engine captures a decode CUDA
        graph of num_seqs rows; a step replays the graph of the smallest bound that holds its longest context
        (`engine/cuda_graphs.py`), so its metadata's max_seq_len is that bound. `width`: the graphs' block-table
        span in tokens (max_model_len in whole blocks). The default, [width]: one graph per batch size."""
        return [width]

    def kernel_ops(self) -> KernelOps:
        """The RMSNorm / SiLU·mul implementation the model should use with this back end."""
        return TORCH_OPS

    @abstractmethod
    def rope_and_cache_write(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                             k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Rotate q and k by their positions and write k (rotated) and v into their cache slots.

        Args:
            q: [num_tokens, num_heads, head_dim]
            k, v: [num_tokens, num_kv_heads, head_dim]
            positions: [num_tokens] int64, absolute positions.
            cos_sin_cache: [max_positions, rotary_dim] float32 (cos half, then sin half).
            k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
            slot_mapping: [num_tokens] int64; -1 skips the write.
            k_scale, v_scale: [num_kv_heads] float32, only with a float8_e4m3fn cache (fp8_kv_cache):
                a value is stored as clamp(value / scale, ±448).
        Returns:
            (q, k) rotated; implementations may rotate in place and return the same tensors.
        """

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, metadata: AttentionMetadata,
                scale: float, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
        """Causal attention of the new tokens over their whole context in the paged cache.

        The new tokens' K/V are already in the cache (rope_and_cache_write ran first); k and v
        are passed too, for back ends that prefer them for the new tokens.

        Args:
            q: [num_tokens, num_heads, head_dim], rotated.
            k, v: [num_tokens, num_kv_heads, head_dim], rotated k.
            k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
            metadata: the step's batch layout.
            scale: softmax scale, usually head_dim ** -0.5.
            k_scale, v_scale: [num_kv_heads] float32 dequantization scales of a float8_e4m3fn cache
                (value = stored * scale); None for a cache in the model's dtype.
        Returns:
            [num_tokens, num_heads, head_dim] in q's dtype; padding rows are unspecified.
        """

    def rope_write_attend(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                          k_cache: Tensor, v_cache: Tensor, metadata: AttentionMetadata, scale: float,
                          **scales: Tensor) -> Tensor:
        """One layer's attention after the qkv projection: RoPE on q and k, k and v into the cache at
        metadata.slot_mapping, then attention of the new tokens over their contexts.

        The default runs `rope_and_cache_write`, then `forward`; back ends may fuse the two (q, k and v
        may then be left unrotated, and the new tokens' K/V reach the cache during the attention).

        Args:
            q: [num_tokens, num_heads, head_dim], not rotated (a view into the qkv output is fine).
            k, v: [num_tokens, num_kv_heads, head_dim], k not rotated.
            positions: [num_tokens] int64, absolute positions.
            cos_sin_cache: [max_positions, rotary_dim] float32 (cos half, then sin half).
            k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
            metadata: the step's batch layout.
            scale: softmax scale.
            scales: k_scale / v_scale of a float8_e4m3fn cache (fp8_kv_cache), else none.
        Returns:
            [num_tokens, num_heads, head_dim] in q's dtype, as `forward` returns it.
        """
        q, k = self.rope_and_cache_write(q, k, v, positions, cos_sin_cache, k_cache, v_cache, metadata.slot_mapping,
                                         **scales)
        return self.forward(q, k, v, k_cache, v_cache, metadata, scale, **scales)
