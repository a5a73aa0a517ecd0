"""SITS_DECODE_PREFETCH (runtime/models/decode_prefetch.py): the plan it names, refused by name when malformed, and
nothing attached where no GPU runs bulk L2 prefetches. The engine's tokens with it on a GPU:
tests/gpu/test_decode_prefetch.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from sits.runtime.models.decode_prefetch import (  # noqa: E402
    PREFETCH_ENV,
    PrefetchPlan,
    attach_decode_prefetch,
    prefetch_plan,
)


@pytest.mark.parametrize(("value", "expected"), [
    ("", PrefetchPlan()),
    (" , ", PrefetchPlan()),
    ("gate_up=512", PrefetchPlan(gate_up_row_bytes=512)),
    ("gate_up=0", PrefetchPlan()),
    ("kv", PrefetchPlan(kv_pages=True)),
    (" gate_up=512 , qkv=1024, kv ", PrefetchPlan(gate_up_row_bytes=512, qkv_row_bytes=1024, kv_pages=True)),
    ("kv,evict_last", PrefetchPlan(kv_pages=True, evict_last=True)),
    ("evict_last", PrefetchPlan(evict_last=True)),  # a policy for nothing: nothing is queued
])
def test_the_plan_it_names(monkeypatch, value, expected):
    monkeypatch.setenv(PREFETCH_ENV, value)
    assert prefetch_plan() == expected
    assert bool(prefetch_plan()) == bool(expected.gate_up_row_bytes or expected.qkv_row_bytes or expected.kv_pages)


def test_unset_it_plans_nothing(monkeypatch):
    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    assert not prefetch_plan() and prefetch_plan().describe() == "nothing"


def test_the_plan_describes_itself():
    plan = PrefetchPlan(gate_up_row_bytes=512, kv_pages=True)
    assert plan.describe() == "gate_up's first 512 bytes a row, the next layer's K / V pages"
    assert PrefetchPlan(qkv_row_bytes=64, evict_last=True).describe() == (
        "the next qkv_proj's first 64 bytes a row (evict last)")
    assert not PrefetchPlan(evict_last=True) and PrefetchPlan(evict_last=True).describe() == "nothing"


@pytest.mark.parametrize("value", ["gate_up=100", "gate_up=-16", "gate_up", "qkv=1k", "down=512", "kv=1", "all",
                                   "evict_last=1"])
def test_a_malformed_item_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(PREFETCH_ENV, value)
    with pytest.raises(ValueError, match=f"{PREFETCH_ENV}: .* is not one of gate_up=<bytes>, qkv=<bytes> .*, kv or "
                                         "evict_last"):
        prefetch_plan()


def test_an_item_given_twice_is_refused(monkeypatch):
    monkeypatch.setenv(PREFETCH_ENV, "gate_up=512,kv,gate_up=1024")
    with pytest.raises(ValueError, match="'gate_up' is given twice"):
        prefetch_plan()


def test_nothing_is_attached_off_a_gpu(monkeypatch):
    """A model that folds its norms, on the CPU: a plan is set, but nothing there runs bulk L2 prefetches."""
    from sits.runtime.models.llama import LlamaForCausalLM

    monkeypatch.setenv(PREFETCH_ENV, "gate_up=512,qkv=512,kv")

    class Folding(torch.nn.Module):
        fold_buckets = frozenset({1, 2, 4})

    model = Folding()
    assert attach_decode_prefetch(model, [], torch.device("cpu")) is None
    assert getattr(model, "decode_prefetch", None) is None
    assert LlamaForCausalLM.decode_prefetch is None
