"""The LoRA delta beside a linear layer, for a batch whose rows use different adapters.

Each targeted `nn.Linear` gets a forward hook that adds `(x · Aᵀ) · Bᵀ` of each row's adapter to its
output. A layer's adapters sit in two preallocated stacks, one slot per adapter plus slot 0 for
"no adapter" (all zeros): A [slots, n·R, in_features] and B [slots, out_features, n·R], where R is
--max-lora-rank and n the number of projections fused in the layer (3 for qkv_proj, 2 for
gate_up_proj, else 1). Projection j's A fills rows j·R .. j·R + r and its B (times the scale) the
output rows of its slice in columns j·R .. j·R + r, so B is block-diagonal and one pair of matmuls
covers every slice; ranks below R and projections an adapter does not target stay zero.

The step's adapter index lives in a `LoraStepState` the model runner owns and fills before each
forward: the rows of each adapter present in the step. The hook runs one pair of matmuls per
adapter present (rows without an adapter cost nothing), all rows at once when one adapter covers the
whole step. The hooks are the only change to the model: its parameters and forward stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


class LoraStepState:
    """Which flat-batch rows use which adapter slot in the current step.

    Attributes:
        groups: (slot, rows) for each adapter slot present, slot > 0; rows is an int64 tensor of flat
            token rows on the device, or None when the slot covers every row. Empty: no adapter runs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def begin_step(self, seq_slots: Sequence[int] | None, query_lens: Sequence[int]) -> None:
        """Set the step's groups from each sequence's slot (0: none) and its new tokens, in batch order."""
        if not seq_slots or not any(seq_slots):
            self.groups = []
            return
        present = sorted(set(seq_slots) - {0})
        if len(present) == 1 and 0 not in seq_slots:
            self.groups = [(present[0], None)]
            return
        token_slots = np.repeat(np.asarray(seq_slots, dtype=np.int64), np.asarray(query_lens, dtype=np.int64))
        self.groups = [(slot, torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self.device, non_blocking=True))
                       for slot in present]

    def clear(self) -> None:
        self.groups = []


class LoraDelta:
    """The stacked adapters of one linear layer, applied as its forward hook.

    Args:
        linear: the base layer ([out_features, in_features] weight).
        slice_sizes: output rows of each fused projection, in order (summing to out_features).
        num_slots: adapter slots, slot 0 ("no adapter") excluded.
        max_rank: R, the rank every slot is sized for.
        step: the runner's per-step adapter index.
    """

    def __init__(self, linear: nn.Linear, slice_sizes: Sequence[int], num_slots: int, max_rank: int,
                 step: LoraStepState) -> None:
        weight = linear.weight
        if sum(slice_sizes) != weight.shape[0]:
            raise ValueError(f"slices {list(slice_sizes)} do not cover {weight.shape[0]} output rows")
        self.slice_starts = np.concatenate([[0], np.cumsum(slice_sizes)]).tolist()
        self.max_rank = max_rank
        self.step = step
        width = len(slice_sizes) * max_rank
        self.lora_a = torch.zeros(num_slots + 1, width, weight.shape[1], dtype=weight.dtype, device=weight.device)
        self.lora_b = torch.zeros(num_slots + 1, weight.shape[0], width, dtype=weight.dtype, device=weight.device)
        self._handle = linear.register_forward_hook(self)

    def set_slice(self, slot: int, index: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """Write projection `index` of an adapter into `slot`: lora_a [r, in], lora_b [slice_out, r]."""
        rank, column = lora_a.shape[0], index * self.max_rank
        start, end = self.slice_starts[index], self.slice_starts[index + 1]
        self.lora_a[slot, column:column + rank] = lora_a.to(self.lora_a.dtype)
        self.lora_b[slot, start:end, column:column + rank] = (lora_b.float() * scale).to(self.lora_b.dtype)

    def remove(self) -> None:
        """Take the hook off the layer (its output is the base layer's again)."""
        self._handle.remove()

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        """output [T, out] += each group's (x[rows] · Aᵀ) · Bᵀ, x = args[0] [T, in]."""
        x = args[0]
        for slot, rows in self.step.groups:
            if rows is None:
                output = output + (x @ self.lora_a[slot].T) @ self.lora_b[slot].T
            else:
                delta = (x.index_select(0, rows) @ self.lora_a[slot].T) @ self.lora_b[slot].T
                output = output.index_add(0, rows, delta)
        return output
