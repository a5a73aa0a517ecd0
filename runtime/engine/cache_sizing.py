"""How many KV blocks fit in the memory budget.

On CPU the budget is `CacheConfig.kv_cache_gb`. On CUDA it is what is left of
`gpu_memory_utilization × total memory` after everything already resident (weights, other
processes) and the activation peak of a profiling forward of `max_num_batched_tokens` tokens.
`CacheConfig.num_blocks` overrides both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sits.runtime.config import CacheConfig, ConfigError

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class KVShape:
    """The per-layer cache geometry: [num_blocks, block_size, num_kv_heads, head_dim] × 2 × layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        """K and V of one block over all layers, in bytes."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True)
class MemoryProfile:
    """CUDA memory after loading and one profiling forward, in bytes.

    Attributes:
        total: the device's memory.
        free: free right now (after the profiling forward's tensors were released).
        activation_peak: how far the profiling forward rose above the resident memory.
    """

    total: int
    free: int
    activation_peak: int


def num_blocks_for_budget(
    cache: CacheConfig, shape: KVShape, device: torch.device, profile: MemoryProfile | None = None
) -> int:
    """Blocks that fit: `cache.num_blocks`, else the CPU budget, else the profiled GPU budget."""
    per_block = shape.bytes_per_block(cache.block_size)
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device.type != "cuda":
        return int(cache.kv_cache_gb * GIB) // per_block
    if profile is None:
        raise ValueError("sizing the KV cache on CUDA needs a memory profile")
    used_now = profile.total - profile.free
    budget = int(profile.total * cache.gpu_memory_utilization) - used_now - profile.activation_peak
    logger.info(
        "GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB activation peak, %.2f GiB for the KV cache",
        profile.total / GIB, used_now / GIB, profile.activation_peak / GIB, max(budget, 0) / GIB,
    )
    if budget < per_block:
        raise ConfigError(
            f"no GPU memory is left for the KV cache at --gpu-memory-utilization {cache.gpu_memory_utilization} "
            f"({used_now / GIB:.2f} GiB already in use, {profile.activation_peak / GIB:.2f} GiB activation peak); "
            "raise it or lower --max-num-batched-tokens"
        )
    return budget // per_block


def check_fits_one_sequence(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """A sequence of max_model_len tokens must fit alone, or it could never finish."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens), "
            f"fewer than one sequence of --max-model-len {max_model_len} needs ({needed} blocks); "
            "raise --kv-cache-gb / --gpu-memory-utilization / --num-blocks or lower --max-model-len"
        )
