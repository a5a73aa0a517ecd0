"""Builds paged KV caches for attention tests: each sequence's tokens in shuffled physical blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.kernels.helpers import DEVICE, randn


@dataclass
class PagedCache:
    """k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32; seq_lens [B] int32."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def random_paged_cache(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    spare_blocks: int = 3,
    extra_table_columns: int = 2,
) -> PagedCache:
    """Random K/V for every context token, scattered over shuffled blocks.

    Spare blocks hold random data no sequence owns, and table padding points at block 0, so a
    kernel that reads past a sequence's end picks up wrong values instead of passing by luck.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    order = torch.randperm(num_blocks).tolist()
    width = max(blocks_per_seq, default=0) + extra_table_columns
    block_tables = torch.zeros(len(seq_lens), max(width, 1), dtype=torch.int32)
    taken = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int32)
        taken += count
    return PagedCache(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
    )


def cumulative(lengths: list[int]) -> torch.Tensor:
    """[len(lengths) + 1] int32 cumulative sums starting at 0 (cu_seqlens)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)
