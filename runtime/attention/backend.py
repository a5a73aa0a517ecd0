"""The attention back-end contract: what the model calls, and the batch metadata it passes.

The model runner builds one `AttentionMetadata` per step and hands it to the model explicitly
(never through module globals). A back end writes the new tokens' K/V into the paged cache and
attends over it, for a flat batch that holds prefill (and chunked-prefill) sequences first and
single-token decodes after them.

Paged KV cache layout, one pair per layer:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's slot is `block_id * block_size + offset`; slot -1 means "padding, do not write".

RoPE table layout (`cos_sin_cache`): [max_positions, rotary_dim] float32, cos in the first
rotary_dim / 2 columns and sin in the second half (rotate-half / NeoX style, as HF Llama uses).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


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
    version: ClassVar[str] = "1"
    priority: ClassVar[int] = 0  # higher wins when several back ends support a configuration

    @classmethod
    @abstractmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """None when this back end can run the configuration, else a short reason for the log."""

    @abstractmethod
    def rope_and_cache_write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k by their positions and write k (rotated) and v into their cache slots.

        Args:
            q: [num_tokens, num_heads, head_dim]
            k, v: [num_tokens, num_kv_heads, head_dim]
            positions: [num_tokens] int64, absolute positions.
            cos_sin_cache: [max_positions, rotary_dim] float32 (cos half, then sin half).
            k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
            slot_mapping: [num_tokens] int64; -1 skips the write.
        Returns:
            (q, k) rotated; implementations may rotate in place and return the same tensors.
        """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of the new tokens over their whole context in the paged cache.

        The new tokens' K/V are already in the cache (rope_and_cache_write ran first); k and v
        are passed too, for back ends that prefer them for the new tokens.

        Args:
            q: [num_tokens, num_heads, head_dim], rotated.
            k, v: [num_tokens, num_kv_heads, head_dim], rotated k.
            k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
            metadata: the step's batch layout.
            scale: softmax scale, usually head_dim ** -0.5.
        Returns:
            [num_tokens, num_heads, head_dim] in q's dtype; padding rows are unspecified.
        """
