"""The engine with decode attention's K / V prefetch (SITS_DECODE_KV_PREFETCH=1) against the engine without it.

The random model of tests/runtime/test_gpu_engine.py and the small-M table of tests/gpu/test_norm_fold.py (every
projection on the Triton kernels, so the qkv projection before each decode attention lets it launch early), CUDA
graphs on. The prefetch changes when the split kernel starts and what is in L2, never a value: the free-running
greedy tokens and the teacher-forced logprobs are the same bits. Skipped without an SM 9.0+ GPU.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels import pdl
from tests.gpu.test_norm_fold import small_m_table  # noqa: F401 - the fixture
from tests.runtime.test_gpu_engine import engine, generate, model, teacher_forced

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and pdl.pdl_supported(torch.device("cuda"))), reason="PDL needs SM 9.0 or later")]
NEW_TOKENS = 96


def _run(monkeypatch, value: str, reference: list[list[int]] | None = None):
    """Greedy tokens and, over `reference` (else those tokens), teacher-forced picks and logprobs."""
    monkeypatch.setenv(pdl.KV_PREFETCH_ENV, value)
    llm = engine(model("triton"), enforce_eager=False)
    assert llm.runner.decode_graphs is not None
    assert llm.runner.model.model.layers[0].self_attn.backend.kv_prefetch is (value == "1")
    tokens = generate(llm, NEW_TOKENS)
    ids, logprobs, _ = teacher_forced(llm, reference or tokens)
    return tokens, ids, logprobs


def test_the_prefetch_changes_no_bit(small_m_table, monkeypatch):  # noqa: F811 - the fixture
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    tokens, ids, logprobs = _run(monkeypatch, "0")
    prefetched_tokens, prefetched_ids, prefetched_logprobs = _run(monkeypatch, "1", tokens)
    assert prefetched_tokens == tokens
    assert prefetched_ids == ids
    assert prefetched_logprobs == logprobs
    print(f"\nRESULT K / V prefetch on against off: {sum(map(len, tokens))} greedy tokens and every teacher-forced "
          f"logprob the same bits")
