"""gate_up's and the next qkv_proj's weight-row prefixes and the next layer's K / V pages prefetched into L2 beside the
attention (SITS_DECODE_PREFETCH: runtime/models/decode_prefetch.py) on the GPU: prefetches are hints, so an
engine with them gives the tokens of an engine without them, bit for bit, eagerly and from CUDA graphs (where the
prefetch is a branch of each captured step).

The random model of tests/runtime/test_gpu_engine.py and the small-M table of tests/gpu/test_norm_fold.py, whose
decode steps fold the norms (the path that prefetches); four prompts, so every decode step has at most
PREFETCH_MAX_TOKENS rows.
"""

from __future__ import annotations

import pytest
import torch

from sits.runtime.models.decode_prefetch import PREFETCH_ENV, PREFETCH_MAX_TOKENS, PrefetchPlan
from tests.gpu.test_norm_fold import small_m_table  # noqa: F401 (a fixture)
from tests.runtime.test_gpu_engine import engine, generate, model

pytestmark = pytest.mark.gpu
LENGTHS = (5, 37, 60, 129)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_the_prefetches_change_no_token(small_m_table, monkeypatch, enforce_eager):  # noqa: F811
    assert len(LENGTHS) <= PREFETCH_MAX_TOKENS
    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    plain = engine(model("triton"), enforce_eager=enforce_eager, max_model_len=256)
    assert plain.runner.model.fold_buckets and plain.runner.model.decode_prefetch is None
    expected = generate(plain, 120, LENGTHS)
    del plain
    monkeypatch.setenv(PREFETCH_ENV, "gate_up=512,qkv=512,kv,evict_last")
    fetched = engine(model("triton"), enforce_eager=enforce_eager, max_model_len=256)
    prefetch = fetched.runner.model.decode_prefetch
    assert prefetch is not None and prefetch.plan == PrefetchPlan(512, 512, True, True)
    assert (fetched.runner.decode_graphs is not None) == (not enforce_eager)
    assert generate(fetched, 120, LENGTHS) == expected
    torch.cuda.synchronize()
