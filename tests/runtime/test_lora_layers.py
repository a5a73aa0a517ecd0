"""The LoRA delta hook on its own: each of its three ways through a step (one adapter on every row,
every slot at once under a mask, rows gathered per adapter) gives every row its own adapter's
output, computed here row by row from the adapters' A and B."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sits.runtime.lora.layers import LoraDelta, LoraStepState

IN, SLICES, RANK, SLOTS = 12, (6, 4), 4, 3


@pytest.fixture
def layer():
    """A fused linear layer (two projections) with three adapters of ranks 4, 2 and 3 (slot 3 only on slice 1)."""
    torch.manual_seed(0)
    linear = nn.Linear(IN, sum(SLICES), bias=True)
    adapters = {}  # slot -> {slice index: (A [r, in], B [slice_out, r], scale)}
    for slot, rank in ((1, 4), (2, 2), (3, 3)):
        slices = (0, 1) if slot < 3 else (1,)
        adapters[slot] = {index: (torch.randn(rank, IN), torch.randn(SLICES[index], rank), 0.5 * slot)
                          for index in slices}
    return linear, adapters


def hooked(linear: nn.Linear, adapters: dict, dense_max_tokens: int) -> LoraStepState:
    step = LoraStepState(torch.device("cpu"), SLOTS, torch.float32, dense_max_tokens=dense_max_tokens)
    delta = LoraDelta(linear, SLICES, SLOTS, RANK, step)
    for slot, slices in adapters.items():
        for index, (lora_a, lora_b, scale) in slices.items():
            delta.set_slice(slot, index, lora_a, lora_b, scale)
    return step


def row_by_row(linear: nn.Linear, adapters: dict, x: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    rows = []
    for row, slot in zip(x, token_slots, strict=True):
        out = linear.weight @ row + linear.bias
        for index, (lora_a, lora_b, scale) in adapters.get(slot, {}).items():
            start = sum(SLICES[:index])
            out[start:start + SLICES[index]] += scale * (lora_b @ (lora_a @ row))
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize("dense_max_tokens", [0, 1024], ids=["per-adapter", "all-slots-masked"])
@pytest.mark.parametrize(("seq_slots", "query_lens"), [
    ([1, 0, 2, 3, 2], [3, 1, 1, 4, 1]),  # a mixed step: prefill chunks and decodes, base rows among them
    ([2, 2, 2], [1, 1, 5]),  # one adapter on every row
    ([0, 0], [2, 1]),  # base model only
    ([3, 0], [1, 1]),
])
def test_each_row_gets_its_own_adapter(layer, dense_max_tokens, seq_slots, query_lens):
    linear, adapters = layer
    step = hooked(linear, adapters, dense_max_tokens)
    token_slots = [slot for slot, length in zip(seq_slots, query_lens, strict=True) for _ in range(length)]
    x = torch.randn(len(token_slots), IN)
    step.begin_step(seq_slots, query_lens)
    mixed = len(set(seq_slots)) > 1 or 0 in seq_slots and any(seq_slots)
    assert (step.slot_mask is not None) == (mixed and dense_max_tokens > 0)
    with torch.no_grad():
        torch.testing.assert_close(linear(x), row_by_row(linear, adapters, x, token_slots), rtol=1e-5, atol=1e-5)
    step.clear()
    with torch.no_grad():
        torch.testing.assert_close(linear(x), x @ linear.weight.T + linear.bias)  # no adapter once cleared
