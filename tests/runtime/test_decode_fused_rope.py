"""The Triton back end's rope_write_attend with the decode rows' RoPE + KV write fused into the decode kernel:
the same logits and cache bits as rope_and_cache_write + forward, step by step, and the same greedy tokens
through the engine (eager, the decode graphs' padded buffers, the piecewise graphs, which keep the unfused
calls)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from sits.kernels import attention_decode  # noqa: E402
from sits.runtime.attention.triton import FUSED_ROPE_ENV, TritonAttentionBackend, fused_rope_env  # noqa: E402
from tests.runtime.test_triton_backend import DEVICE, WAVES, engine_for, prompt, run_schedule, tiny_model  # noqa: E402
from tests.support.model_driver import PagedKVCache, PagedSequence, run_step  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not attention_decode.is_interpreter(),
                                reason="needs the interpreter")


@pytest.fixture
def fusion(monkeypatch):
    """fusion(on): the Triton back end fuses (or not) from now on, whatever the environment said."""
    monkeypatch.delenv(FUSED_ROPE_ENV, raising=False)

    def switch(on: bool) -> None:
        monkeypatch.setattr(attention_decode, "FUSED_ROPE_DEFAULT", on)

    return switch


@pytest.fixture(scope="module")
def loaded():
    return tiny_model("triton")


def count_rope_rows(backend: TritonAttentionBackend, monkeypatch) -> list[int]:
    """The rows each rope_and_cache_write call of `backend` gets, recorded as the calls happen."""
    rows: list[int] = []
    original = backend.rope_and_cache_write

    def recorded(q, *args, **kwargs):
        rows.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(backend, "rope_and_cache_write", recorded)
    return rows


def test_environment_switch(monkeypatch):
    for value, expected in (("", None), ("0", False), ("off", False), ("1", True)):
        monkeypatch.setenv(FUSED_ROPE_ENV, value)
        assert fused_rope_env() is expected
        assert TritonAttentionBackend().fused_rope is (attention_decode.FUSED_ROPE_DEFAULT if expected is None
                                                       else expected)


def _steps(model, fused: bool, fusion) -> tuple[list[torch.Tensor], PagedKVCache]:
    """Prefills, a mixed step (a prompt + three decodes, new tokens at a page's first and last slots), then decodes:
    the logits of every step and the cache afterwards."""
    fusion(fused)
    cache = PagedKVCache(model, num_blocks=24, block_size=16)
    seqs = [PagedSequence(prompt(10 + i, n) + prompt(20 + i, 6)) for i, n in enumerate((16, 15, 31))]
    late = PagedSequence(prompt(30, 9) + prompt(31, 6))
    logits = [run_step(model, cache, [(s, len(s.token_ids) - 6) for s in seqs])]
    logits.append(run_step(model, cache, [(late, 9)] + [(s, 1) for s in seqs]))
    for _ in range(4):
        logits.append(run_step(model, cache, [(s, 1) for s in seqs + [late]]))
    return logits, cache


def test_steps_are_bit_identical_with_the_fusion(loaded, fusion, monkeypatch):
    backend = loaded.model.backend
    rows = count_rope_rows(backend, monkeypatch)
    plain, plain_cache = _steps(loaded.model, False, fusion)
    assert rows == [62] * 2 + [12] * 2 + [4] * 8  # every token, both layers
    rows.clear()
    fused, fused_cache = _steps(loaded.model, True, fusion)
    assert rows == [62] * 2 + [9] * 2  # only prompt tokens: the decode rows' RoPE + KV write ran in attention
    for step, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ"
    for (k, v), (k_ref, v_ref) in zip(fused_cache.caches, plain_cache.caches, strict=True):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("max_batched", [512, 16], ids=["whole-prompts", "chunked-prefill"])
def test_engine_tokens_are_the_same_with_the_fusion(loaded, fusion, max_batched):
    fusion(False)
    expected = run_schedule(engine_for(loaded, max_batched=max_batched), WAVES)
    fusion(True)
    assert run_schedule(engine_for(loaded, max_batched=max_batched), WAVES) == expected


def test_graph_paths_give_the_same_tokens_with_the_fusion(loaded, fusion):
    """The decode graphs' static padded batch (a padding row: slot -1, seq_len 0) and the piecewise graphs'
    holes, eager on a CPU, captured on a GPU."""
    capture = torch.cuda.is_available()
    fusion(False)
    expected = run_schedule(engine_for(loaded, max_batched=16), WAVES)
    fusion(True)
    engine = engine_for(loaded, max_batched=16)
    engine.runner.setup_cuda_graphs([1, 2, 4, 8], max_model_len=128, capture=capture)
    engine.runner.setup_piecewise_graphs([8, 16], capture=capture)
    assert run_schedule(engine, WAVES) == expected
