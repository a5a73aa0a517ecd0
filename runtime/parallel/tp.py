"""Tensor parallelism as a conversion of a built `LlamaForCausalLM`, in place (gpt-fast's tp.py way).

Load (or randomly build) the full model on every rank, then call `apply_tensor_parallel`: each rank
keeps its shard and the layers that must talk are swapped for those in `layers.py`.

    qkv_proj      column-parallel: rank r keeps query heads r*Hq/tp .. and its K/V heads
    o_proj        row-parallel (all-reduce)
    gate_up_proj  column-parallel: rank r keeps MLP columns r*I/tp .. of gate and of up
    down_proj     row-parallel (all-reduce)
    embed_tokens  vocab-parallel (all-reduce);  lm_head  vocab-parallel (all-gather of logits)
    norms, RoPE table: replicated

K/V heads: with tp <= num_kv_heads each rank keeps num_kv_heads / tp of them (tp must divide it);
with tp > num_kv_heads each rank keeps the one K/V head its query heads attend with (tp must be a
multiple of num_kv_heads), replicated on tp / num_kv_heads ranks. Any other size is refused with the
sizes that would work. A rank's KV cache holds only its own K/V heads: size it with
`local_kv_cache_shape`, not the checkpoint config.

Tied embeddings stay tied: the LM head shares the embedding's shard. Weights must be loaded before
the conversion (loading reads the full-size slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sits.runtime.config import ConfigError
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from sits.runtime.parallel.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead


class TensorParallelError(ConfigError):
    """The model cannot be split over this many ranks; the message says why and what would work."""


@dataclass(frozen=True)
class TensorParallelLayout:
    """What one rank holds after the conversion.

    Attributes:
        rank, world_size: this rank and the tensor-parallel size.
        num_heads, num_kv_heads: query and K/V heads on this rank.
        intermediate_size: MLP columns on this rank.
        vocab_start, vocab_rows: the vocabulary rows of the embedding and LM head on this rank.
    """

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_start: int
    vocab_rows: int


def tensor_parallel_problems(config: LlamaConfig, world_size: int) -> list[str]:
    """Why `world_size` ranks cannot split this model (empty when they can)."""
    problems = []
    if world_size < 1:
        return [f"the tensor-parallel size must be positive, got {world_size}"]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        problems.append(f"num_attention_heads ({heads}) is not divisible by it")
    if kv_heads % world_size and world_size % kv_heads:
        problems.append(f"num_key_value_heads ({kv_heads}) neither is divisible by it nor divides it")
    if config.intermediate_size % world_size:
        problems.append(f"intermediate_size ({config.intermediate_size}) is not divisible by it")
    return problems


def supported_tensor_parallel_sizes(config: LlamaConfig) -> list[int]:
    """Every size this model can be split over (at most its number of query heads)."""
    return [size for size in range(1, config.num_attention_heads + 1) if not tensor_parallel_problems(config, size)]


def check_tensor_parallel_size(config: LlamaConfig, world_size: int) -> None:
    """Raise TensorParallelError naming each reason and the sizes that would work."""
    problems = tensor_parallel_problems(config, world_size)
    if problems:
        sizes = ", ".join(str(s) for s in supported_tensor_parallel_sizes(config))
        raise TensorParallelError(
            f"--tensor-parallel-size {world_size} cannot split this model: {'; '.join(problems)} "
            f"(sizes that work for it: {sizes})"
        )


def plan_layout(config: LlamaConfig, rank: int, world_size: int) -> TensorParallelLayout:
    """The shard sizes of `rank` (after check_tensor_parallel_size passed)."""
    vocab_rows = -(-config.vocab_size // world_size)
    return TensorParallelLayout(
        rank=rank,
        world_size=world_size,
        num_heads=config.num_attention_heads // world_size,
        num_kv_heads=max(1, config.num_key_value_heads // world_size),
        intermediate_size=config.intermediate_size // world_size,
        vocab_start=rank * vocab_rows,
        vocab_rows=vocab_rows,
    )


@torch.no_grad()
def apply_tensor_parallel(
    model: LlamaForCausalLM, rank: int, world_size: int, group: dist.ProcessGroup | None = None
) -> LlamaForCausalLM:
    """Shard a loaded model for `rank` of `world_size`, in place; returns the same model.

    After this, the model's forward and compute_logits take the same inputs and return the same
    full-size outputs on every rank, as long as every rank of `group` calls them together.

    Raises:
        TensorParallelError: the size does not divide the model (see the module docstring).
    """
    if not 0 <= rank < world_size:
        raise TensorParallelError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    config = model.config
    check_tensor_parallel_size(config, world_size)
    layout = plan_layout(config, rank, world_size)
    if world_size > 1:
        for layer in model.model.layers:
            _shard_attention(layer.self_attn, config, layout, group)
            _shard_mlp(layer.mlp, layout, group)
        _shard_vocabulary(model, config, layout, group)
    model.tensor_parallel = layout
    return model


def local_kv_heads(model: LlamaForCausalLM) -> int:
    """K/V heads this rank's attention layers hold (= its KV cache's heads)."""
    return model.model.layers[0].self_attn.num_kv_heads


def local_kv_cache_shape(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """One layer's k_cache (and v_cache) on this rank: [num_blocks, block_size, local kv heads, head_dim]."""
    return (num_blocks, block_size, local_kv_heads(model), model.config.head_dim)


# -- the shards -------------------------------------------------------------------------------


def _rows(weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return weight.narrow(0, start, count)


def _kv_head_start(config: LlamaConfig, layout: TensorParallelLayout) -> int:
    if config.num_key_value_heads >= layout.world_size:
        return layout.rank * layout.num_kv_heads
    # Fewer K/V heads than ranks: rank r's query heads all attend with K/V head r * Hkv / tp.
    return layout.rank * config.num_key_value_heads // layout.world_size


def _shard_attention(attn: LlamaAttention, config: LlamaConfig, layout: TensorParallelLayout, group) -> None:
    head_dim = config.head_dim
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    q_rows, kv_rows = layout.num_heads * head_dim, layout.num_kv_heads * head_dim
    q_start = layout.rank * q_rows
    kv_start = _kv_head_start(config, layout) * head_dim

    def qkv_shard(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([
            _rows(tensor, q_start, q_rows),
            _rows(tensor, q_size + kv_start, kv_rows),
            _rows(tensor, q_size + kv_size + kv_start, kv_rows),
        ]).contiguous()

    qkv = attn.qkv_proj
    qkv.weight = nn.Parameter(qkv_shard(qkv.weight), requires_grad=False)
    if qkv.bias is not None:
        qkv.bias = nn.Parameter(qkv_shard(qkv.bias), requires_grad=False)
    qkv.out_features = q_rows + 2 * kv_rows

    o = attn.o_proj
    o_weight = o.weight.narrow(1, q_start, q_rows).contiguous()
    attn.o_proj = RowParallelLinear(o_weight, None if o.bias is None else o.bias.detach().clone(), group)

    attn.num_heads, attn.num_kv_heads = layout.num_heads, layout.num_kv_heads
    attn.q_size, attn.kv_size = q_rows, kv_rows


def _shard_mlp(mlp: LlamaMLP, layout: TensorParallelLayout, group) -> None:
    full, local = mlp.intermediate_size, layout.intermediate_size
    start = layout.rank * local

    def gate_up_shard(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([_rows(tensor, start, local), _rows(tensor, full + start, local)]).contiguous()

    gate_up = mlp.gate_up_proj
    gate_up.weight = nn.Parameter(gate_up_shard(gate_up.weight), requires_grad=False)
    if gate_up.bias is not None:
        gate_up.bias = nn.Parameter(gate_up_shard(gate_up.bias), requires_grad=False)
    gate_up.out_features = 2 * local

    down = mlp.down_proj
    down_weight = down.weight.narrow(1, start, local).contiguous()
    mlp.down_proj = RowParallelLinear(down_weight, None if down.bias is None else down.bias.detach().clone(), group)
    mlp.intermediate_size = local


def _vocab_shard(weight: torch.Tensor, layout: TensorParallelLayout) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] matrix, zero-padded to layout.vocab_rows."""
    shard = weight.new_zeros((layout.vocab_rows, weight.shape[1]))
    available = max(0, min(layout.vocab_rows, weight.shape[0] - layout.vocab_start))
    shard[:available] = weight[layout.vocab_start: layout.vocab_start + available]
    return shard


def _shard_vocabulary(model: LlamaForCausalLM, config: LlamaConfig, layout: TensorParallelLayout, group) -> None:
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    embedding = VocabParallelEmbedding(_vocab_shard(model.model.embed_tokens.weight, layout), layout.vocab_start, group)
    head_weight = embedding.weight if tied else nn.Parameter(
        _vocab_shard(model.lm_head.weight, layout), requires_grad=False
    )
    model.model.embed_tokens = embedding
    model.lm_head = VocabParallelLMHead(head_weight, config.vocab_size, group)
