"""SITS_GATE_UP_PREFETCH and SITS_KV_PREFETCH (runtime/models/decode_prefetch.py): what they ask for, refused by name
when malformed, and nothing attached where no GPU runs bulk L2 prefetches. The engine's tokens with them on a GPU:
tests/gpu/test_decode_prefetch.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from sits.runtime.models.decode_prefetch import (  # noqa: E402
    KV_ENV,
    ROWS_ENV,
    attach_decode_prefetch,
    prefetch_kv_pages,
    prefetch_row_bytes,
)


@pytest.mark.parametrize(("value", "expected"), [("", 0), ("0", 0), ("512", 512), (" 1024 ", 1024)])
def test_the_bytes_a_row_it_asks_for(monkeypatch, value, expected):
    monkeypatch.setenv(ROWS_ENV, value)
    assert prefetch_row_bytes() == expected


@pytest.mark.parametrize(("value", "expected"), [("", False), ("0", False), ("off", False), ("1", True),
                                                 ("ON", True), ("yes", True)])
def test_the_pages_switch(monkeypatch, value, expected):
    monkeypatch.setenv(KV_ENV, value)
    assert prefetch_kv_pages() is expected


def test_unset_both_are_off(monkeypatch):
    monkeypatch.delenv(ROWS_ENV, raising=False)
    monkeypatch.delenv(KV_ENV, raising=False)
    assert prefetch_row_bytes() == 0 and prefetch_kv_pages() is False


@pytest.mark.parametrize("value", ["100", "-16", "512B", "half"])
def test_a_malformed_row_size_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(ROWS_ENV, value)
    with pytest.raises(ValueError, match=f"{ROWS_ENV} must be a non-negative multiple of 16"):
        prefetch_row_bytes()


@pytest.mark.parametrize("value", ["2", "maybe", "-1"])
def test_a_malformed_pages_switch_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(KV_ENV, value)
    with pytest.raises(ValueError, match=f"{KV_ENV} must be 1 or 0"):
        prefetch_kv_pages()


def test_nothing_is_attached_off_a_gpu(monkeypatch):
    """A model that folds its norms, on the CPU: both switches set, but nothing there runs bulk L2 prefetches."""
    from sits.runtime.models.llama import LlamaForCausalLM

    monkeypatch.setenv(ROWS_ENV, "512")
    monkeypatch.setenv(KV_ENV, "1")

    class Folding(torch.nn.Module):
        fold_buckets = frozenset({1, 2, 4})

    model = Folding()
    assert attach_decode_prefetch(model, [], torch.device("cpu")) is None
    assert getattr(model, "decode_prefetch", None) is None
    assert LlamaForCausalLM.decode_prefetch is None
