"""The LoRA delta beside a linear layer, for a batch whose rows use different adapters.

Each targeted `nn.Linear` gets a forward hook that adds `(x · Aᵀ) · Bᵀ` of each row's adapter to its
output. A layer's adapters sit in two preallocated stacks, one slot per adapter plus slot 0 for
"no adapter" (all zeros): A [slots, n·R, in_features] and Bᵀ [slots, n·R, out_features], where R is
--max-lora-rank and n the number of projections fused in the layer (3 for qkv_proj, 2 for
gate_up_proj, else 1). Projection j's A fills rows j·R .. j·R + r and its Bᵀ (times the scale) the
columns of its output slice in rows j·R .. j·R + r, so B is block-diagonal and one pair of matmuls
covers every slice; ranks below R and projections an adapter does not target stay zero.

The step's adapter index lives in a `LoraStepState` the model runner owns and fills before each
forward. Three ways to apply it, chosen once per step:
  - one adapter on every row: one pair of matmuls over all rows;
  - a mixed step of at most `dense_max_tokens` rows (decodes, short prefills): one pair of matmuls
    over every adapter slot at once, x · [A_1; ...; A_S]ᵀ masked to each row's own slot, then
    · [Bᵀ_1; ...; Bᵀ_S]: four operations per layer whatever the number of adapters, where a loop
    over adapters would launch four per adapter (the cost of small steps is launches, not FLOPs);
  - a larger mixed step: per adapter present, its rows gathered, one pair of matmuls, added back
    (FLOPs for the rows' own adapters only).
The hooks are the only change to the model: its parameters and forward stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

DENSE_MAX_TOKENS = 256  # mixed steps up to this many rows use every slot at once (see the module doc)


class LoraStepState:
    """Which flat-batch rows use which adapter slot in the current step.

    Attributes:
        groups: (slot, rows) for each adapter slot present, slot > 0; rows is an int64 tensor of flat
            token rows on the device, or None when the slot covers every row. Empty: no adapter runs.
            Used when `slot_mask` is None.
        slot_mask: for a mixed step of at most `dense_max_tokens` rows: [rows, num_slots] with 1.0
            where the row runs that slot's adapter (slot 1 in column 0); else None.
    """

    def __init__(self, device: torch.device, num_slots: int = 0, dtype: torch.dtype = torch.float32,
                 dense_max_tokens: int = DENSE_MAX_TOKENS) -> None:
        self.device = device
        self.num_slots = num_slots
        self.dtype = dtype
        self.dense_max_tokens = dense_max_tokens
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.slot_mask: torch.Tensor | None = None

    def begin_step(self, seq_slots: Sequence[int] | None, query_lens: Sequence[int]) -> None:
        """Set the step's groups from each sequence's slot (0: none) and its new tokens, in batch order."""
        self.slot_mask = None
        if not seq_slots or not any(seq_slots):
            self.groups = []
            return
        present = sorted(set(seq_slots) - {0})
        if len(present) == 1 and 0 not in seq_slots:
            self.groups = [(present[0], None)]
            return
        token_slots = np.repeat(np.asarray(seq_slots, dtype=np.int64), np.asarray(query_lens, dtype=np.int64))
        if self.num_slots > 0 and len(token_slots) <= self.dense_max_tokens:
            mask = np.zeros((len(token_slots), self.num_slots), dtype=np.float32)
            rows = np.flatnonzero(token_slots)
            mask[rows, token_slots[rows] - 1] = 1.0
            self.slot_mask = torch.from_numpy(mask).to(self.device, self.dtype, non_blocking=True)
            self.groups = []
            return
        self.groups = [(slot, torch.from_numpy(np.flatnonzero(token_slots == slot)).to(self.device, non_blocking=True))
                       for slot in present]

    def clear(self) -> None:
        self.groups = []
        self.slot_mask = None


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
        self.width = len(slice_sizes) * max_rank
        self.lora_a = torch.zeros(num_slots + 1, self.width, weight.shape[1], dtype=weight.dtype, device=weight.device)
        self.lora_b_t = torch.zeros(num_slots + 1, self.width, weight.shape[0], dtype=weight.dtype,
                                    device=weight.device)
        # Every adapter slot side by side (views of the stacks): [S·width, in] and [S·width, out].
        self.all_a = self.lora_a[1:].reshape(num_slots * self.width, weight.shape[1])
        self.all_b_t = self.lora_b_t[1:].reshape(num_slots * self.width, weight.shape[0])
        self._handle = linear.register_forward_hook(self)

    def set_slice(self, slot: int, index: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """Write projection `index` of an adapter into `slot`: lora_a [r, in], lora_b [slice_out, r]."""
        rank, column = lora_a.shape[0], index * self.max_rank
        start, end = self.slice_starts[index], self.slice_starts[index + 1]
        self.lora_a[slot, column:column + rank] = lora_a.to(self.lora_a.dtype)
        self.lora_b_t[slot, column:column + rank, start:end] = (lora_b.float() * scale).T.to(self.lora_b_t.dtype)

    def clear_slot(self, slot: int) -> None:
        """Zero `slot` (an unloaded adapter's): its rows add nothing until another adapter is written there."""
        self.lora_a[slot].zero_()
        self.lora_b_t[slot].zero_()

    def remove(self) -> None:
        """Take the hook off the layer (its output is the base layer's again)."""
        self._handle.remove()

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        """output [T, out] += each row's (x · Aᵀ) · Bᵀ under its own adapter, x = args[0] [T, in]."""
        x = args[0]
        mask = self.step.slot_mask
        if mask is not None:  # a small mixed step: every slot at once, each row keeping its own
            low_rank = (x @ self.all_a.T).view(x.shape[0], -1, self.width) * mask.unsqueeze(-1)
            return output + low_rank.view(x.shape[0], -1) @ self.all_b_t
        for slot, rows in self.step.groups:
            if rows is None:
                output = output + (x @ self.lora_a[slot].T) @ self.lora_b_t[slot]
            else:
                delta = (x.index_select(0, rows) @ self.lora_a[slot].T) @ self.lora_b_t[slot]
                output = output.index_add(0, rows, delta)
        return output
