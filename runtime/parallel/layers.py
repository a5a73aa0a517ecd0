"""The layers a tensor-parallel Llama swaps in: each holds one rank's shard and does its collective.

Column-parallel projections (q/k/v, gate/up) need no layer of their own: their shard is an ordinary
`nn.Linear` with fewer output rows, and its output stays split by head / by MLP column. What needs
communication lives here:

- `RowParallelLinear`: input features split over ranks; partial products summed by all-reduce.
- `VocabParallelEmbedding`: vocabulary rows split; each rank embeds the ids it owns, all-reduce.
- `VocabParallelLMHead`: vocabulary rows split; each rank scores its rows, all-gather of logits.

The vocabulary is padded to a multiple of the world size with zero rows, so any vocabulary works.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sits.runtime.models.kernel_ops import logits_float32

# torch 2.13 renamed all_gather_into_tensor; older releases (the GPU image's 2.11) have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RowParallelLinear(nn.Module):
    """y = all_reduce_sum(x_shard @ W_shard^T) + b.

    The local product is an ordinary `nn.Linear` (`self.linear`, no bias), so a conversion that
    swaps nn.Linear layers (weight quantization) converts the shard too.

    Args:
        weight: [out_features, in_features / world_size], this rank's columns of the full weight.
        bias: [out_features] or None; the full bias, added once after the reduction.
        group: the tensor-parallel process group (None: the default group).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        out_features, in_shard = weight.shape
        self.linear = nn.Linear(in_shard, out_features, bias=False, device="meta")  # no init: the shard fills it
        self.linear.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features / world_size] → [num_tokens, out_features], equal on every rank."""
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over ranks.

    Args:
        weight: [rows_per_rank, hidden_size], full-vocabulary rows vocab_start .. vocab_start + rows_per_rank
            (rows past the vocabulary are zero padding).
        vocab_start: the first token id this rank owns.
        group: the tensor-parallel process group.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [num_tokens] int64 → [num_tokens, hidden_size], equal on every rank."""
        local = input_ids - self.vocab_start
        not_mine = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(not_mine, 0), self.weight)
        out = out.masked_fill(not_mine.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)  # exactly one rank holds each row: the sum is exact
        return out

    def extra_repr(self) -> str:
        return f"vocab_start={self.vocab_start}, rows_per_rank={self.weight.shape[0]}, hidden={self.weight.shape[1]}"


class VocabParallelLMHead(nn.Module):
    """Output head whose vocabulary rows are split over ranks; logits are gathered to every rank.

    Args:
        weight: [rows_per_rank, hidden_size] (may be the embedding's parameter when tied).
        vocab_size: the real vocabulary; the gathered padding columns are cut off.
        group: the tensor-parallel process group.
    """

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] → logits [N, vocab_size] float32 (never rounded to the weight's dtype,
        see `logits_float32`), equal on every rank."""
        local = logits_float32(hidden, self.weight)  # [N, rows_per_rank]
        world_size = dist.get_world_size(self.group)
        num_rows, rows_per_rank = local.shape
        gathered = local.new_empty((world_size * num_rows, rows_per_rank))
        _all_gather_single(gathered, local.contiguous(), group=self.group)
        # [world * N, rows] → [N, world * rows]: rank r's rows are vocabulary ids r*rows .. (r+1)*rows-1.
        logits = gathered.view(world_size, num_rows, rows_per_rank).permute(1, 0, 2).reshape(num_rows, -1)
        return logits[:, : self.vocab_size]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, rows_per_rank={self.weight.shape[0]}, hidden={self.weight.shape[1]}"
