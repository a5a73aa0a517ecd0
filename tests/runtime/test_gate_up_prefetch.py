"""SITS_GATE_UP_PREFETCH (runtime/models/gate_up_prefetch.py): the bytes a row it asks for, refused when malformed,
and nothing attached where no GPU runs bulk L2 prefetches. The engine's tokens with it on a GPU:
tests/gpu/test_gate_up_prefetch.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from sits.runtime.models.gate_up_prefetch import (  # noqa: E402
    PREFETCH_ENV,
    attach_gate_up_prefetch,
    prefetch_row_bytes,
)


@pytest.mark.parametrize(("value", "expected"), [("", 0), ("0", 0), ("512", 512), (" 1024 ", 1024)])
def test_the_bytes_a_row_it_asks_for(monkeypatch, value, expected):
    monkeypatch.setenv(PREFETCH_ENV, value)
    assert prefetch_row_bytes() == expected


def test_unset_it_is_off(monkeypatch):
    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    assert prefetch_row_bytes() == 0


@pytest.mark.parametrize("value", ["100", "-16", "512B", "half"])
def test_a_malformed_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(PREFETCH_ENV, value)
    with pytest.raises(ValueError, match=f"{PREFETCH_ENV} must be a non-negative multiple of 16"):
        prefetch_row_bytes()


def test_nothing_is_attached_off_a_gpu(monkeypatch):
    """A model that folds its norms, on the CPU: the switch is set but nothing there runs bulk L2 prefetches."""
    from sits.runtime.models.llama import LlamaForCausalLM

    monkeypatch.setenv(PREFETCH_ENV, "512")

    class Folding(torch.nn.Module):
        fold_buckets = frozenset({1, 2, 4})

    model = Folding()
    assert attach_gate_up_prefetch(model, torch.device("cpu")) is None
    assert getattr(model, "gate_up_prefetch", None) is None
    assert LlamaForCausalLM.gate_up_prefetch is None
