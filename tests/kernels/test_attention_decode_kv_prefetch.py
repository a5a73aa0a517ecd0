"""Decode attention's K / V prefetch (paged_decode_attention(kv_prefetch=True), SITS_DECODE_KV_PREFETCH).

CPU: how many tokens a launch queues for L2 (`kv_prefetch_tokens`), the switch's parsing, that a small-M GEMM lets
its dependents launch early only where it is asked for and PDL runs, and that under the interpreter the flag is
accepted and changes nothing. GPU (SM 9.0+): a qkv projection on the small-M GEMM (which then lets the next grid
launch at once) followed by decode attention with the RoPE + KV write fused in, its split kernel launched with PDL
and prefetching before its wait, eagerly and captured in a CUDA graph, gives the bits and the cache writes of the
same chain without the prefetch, at batches 1, 4 and 32 and over bf16 and fp8 caches.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels import pdl
from sits.kernels.attention_decode import (
    KV_PREFETCH_L2_BYTES,
    KV_PREFETCH_MAX_TOKENS,
    DecodeRope,
    kv_prefetch_tokens,
    paged_decode_attention,
    plan_decode_splits,
)
from sits.kernels.gemm_small_m import small_m_gemm
from sits.kernels.rope_kv_write import build_cos_sin_cache
from tests.kernels.helpers import DEVICE, ON_GPU

H200_SMS = 132
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def _tokens(batch: int, context: int, element_size: int = 2) -> int:
    plan = plan_decode_splits(batch, KV_HEADS, context, H200_SMS, None)
    return kv_prefetch_tokens(plan, batch, KV_HEADS, HEAD_DIM, element_size)


def test_batch_one_prefetches_whole_splits():
    plan = plan_decode_splits(1, KV_HEADS, 2048, H200_SMS, None)
    assert (plan.num_splits, plan.tokens_per_split) == (8, 256)
    assert _tokens(1, 2048) == 256  # 64 programs x 256 tokens x 2 x 256 B = 8 MiB, within the budget


def test_the_budget_bounds_what_a_launch_queues():
    for batch, context, element_size in ((1, 2048, 2), (4, 4096, 2), (32, 2048, 2), (32, 2048, 1), (64, 8192, 2)):
        plan = plan_decode_splits(batch, KV_HEADS, context, H200_SMS, None)
        tokens = _tokens(batch, context, element_size)
        programs = batch * KV_HEADS * plan.num_splits
        assert tokens == 0 or 2 * programs * tokens * HEAD_DIM * element_size <= KV_PREFETCH_L2_BYTES
        assert tokens & (tokens - 1) == 0 and tokens <= KV_PREFETCH_MAX_TOKENS
    assert _tokens(32, 2048) == 128  # 256 programs: 16 MiB / (256 x 512 B)
    assert _tokens(32, 2048, element_size=1) == 256  # an fp8 row is half as long
    assert _tokens(448, 3072) == 0  # 3,584 programs: under 16 tokens each, so none


def test_another_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("SITS_DECODE_KV_PREFETCH_KIB", "1024")  # 1 MiB: 32 tokens (16 KiB of K and V) for 64 programs
    assert _tokens(1, 2048) == 32
    monkeypatch.setenv("SITS_DECODE_KV_PREFETCH_KIB", "256")  # 8 tokens each: under a page, so none
    assert _tokens(1, 2048) == 0
    monkeypatch.setenv("SITS_DECODE_KV_PREFETCH_KIB", "2MB")
    with pytest.raises(ValueError, match="SITS_DECODE_KV_PREFETCH_KIB"):
        _tokens(1, 2048)


def test_a_short_split_is_not_padded_past_a_power_of_two():
    assert _tokens(1, 100) == 128  # one split of the whole 100-token context, rounded up to the arange


@pytest.mark.parametrize(("value", "wanted"), [("1", True), ("on", True), ("0", False), ("off", False),
                                                ("", pdl.KV_PREFETCH_DEFAULT)])
def test_the_switch(monkeypatch, value, wanted):
    monkeypatch.setenv(pdl.KV_PREFETCH_ENV, value)
    assert pdl.kv_prefetch_requested() is wanted


@pytest.mark.skipif(ON_GPU, reason="the CPU's answer")
def test_no_gemm_triggers_off_a_hopper_gpu(monkeypatch):
    monkeypatch.setenv(pdl.KV_PREFETCH_ENV, "1")
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.gemm_pdl_options(torch.device("cpu")) == {}


@pytest.mark.skipif(ON_GPU, reason="the interpreter's answer")
def test_the_flag_changes_nothing_under_the_interpreter():
    step = _step(batch=2, context=300, cache_dtype=torch.float16, dtype=torch.float16)
    plain = _chain(step, kv_prefetch=False)
    again = _step(batch=2, context=300, cache_dtype=torch.float16, dtype=torch.float16)
    assert torch.equal(plain, _chain(again, kv_prefetch=True))
    assert torch.equal(step["k_cache"], again["k_cache"]) and torch.equal(step["v_cache"], again["v_cache"])


def _step(batch: int, context: int, cache_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16,
          hidden: int = 512) -> dict:
    """One decode step's inputs: x [B, hidden] into a qkv projection, a paged cache holding `context` tokens of each
    sequence in shuffled pages, the new token at position `context`."""
    g = torch.Generator(device=DEVICE).manual_seed(batch * 1000 + context)
    pages = (context + PAGE) // PAGE + 1
    num_blocks = batch * pages
    shape = (num_blocks, PAGE, KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=g, device=DEVICE) for _ in range(2)]
    if cache_dtype == torch.float8_e4m3fn:
        caches = [(c * 20).clamp(-448, 448).to(cache_dtype) for c in caches]
    else:
        caches = [c.to(cache_dtype) for c in caches]
    tables = torch.randperm(num_blocks, generator=g, device=DEVICE).to(torch.int32).view(batch, pages)
    positions = torch.full((batch,), context, dtype=torch.int64, device=DEVICE)
    slots = tables[:, context // PAGE].long() * PAGE + context % PAGE
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {"x": (torch.randn(batch, hidden, generator=g, device=DEVICE) * 0.5).to(dtype),
            "w": (torch.randn(qkv_width, hidden, generator=g, device=DEVICE) * 0.05).to(dtype),
            "k_cache": caches[0], "v_cache": caches[1], "tables": tables,
            "seq_lens": torch.full((batch,), context + 1, dtype=torch.int32, device=DEVICE),
            "positions": positions, "slots": slots, "cos_sin": build_cos_sin_cache(HEAD_DIM, context + 64, device=DEVICE),
            "scales": {"k_scale": torch.full((KV_HEADS,), 0.05, device=DEVICE),
                       "v_scale": torch.full((KV_HEADS,), 0.05, device=DEVICE)}
            if cache_dtype == torch.float8_e4m3fn else {}}  # fmt: skip


def _chain(step: dict, kv_prefetch: bool) -> torch.Tensor:
    """qkv = x W^T on the small-M GEMM, then decode attention with the RoPE + KV write fused: out [B, Hq, D]."""
    qkv = small_m_gemm(step["x"], step["w"])
    q, k, v = (t.reshape(t.shape[0], -1, HEAD_DIM) for t in qkv.split(
        [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))  # fmt: skip
    rope = DecodeRope(k, v, step["positions"], step["cos_sin"], step["slots"])
    return paged_decode_attention(q, step["k_cache"], step["v_cache"], step["tables"], step["seq_lens"],
                                  HEAD_DIM**-0.5, rope=rope, kv_prefetch=kv_prefetch, **step["scales"])


def _graphed(step: dict, kv_prefetch: bool) -> torch.Tensor:
    """_chain warmed up (compiling and autotuning), the caches put back, captured in a CUDA graph and replayed."""
    pristine = [step["k_cache"].clone(), step["v_cache"].clone()]
    _chain(step, kv_prefetch)
    torch.cuda.synchronize()
    step["k_cache"].copy_(pristine[0])
    step["v_cache"].copy_(pristine[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(step, kv_prefetch)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and pdl.pdl_supported(DEVICE)), reason="PDL needs SM 9.0 or later")
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(("batch", "context", "cache_dtype"), [
    (1, 2047, torch.bfloat16), (4, 1000, torch.bfloat16), (32, 2047, torch.bfloat16), (1, 2047, torch.float8_e4m3fn),
    (3, 129, torch.bfloat16),
])  # fmt: skip
def test_prefetching_changes_no_bit(monkeypatch, batch, context, cache_dtype, graphed):
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    run = _graphed if graphed else lambda step, prefetch: _chain(step, prefetch).clone()
    monkeypatch.setenv(pdl.KV_PREFETCH_ENV, "0")
    plain_step = _step(batch, context, cache_dtype)
    plain = run(plain_step, False)
    monkeypatch.setenv(pdl.KV_PREFETCH_ENV, "1")
    assert pdl.gemm_pdl_options(DEVICE) == {"USE_PDL": pdl.PDL_EARLY}  # the GEMM lets the attention start early
    step = _step(batch, context, cache_dtype)
    for _ in range(3):  # replays race differently each time, if they race at all
        got = run(step, True)
        assert torch.equal(plain, got)
    assert torch.equal(plain_step["k_cache"], step["k_cache"]) and torch.equal(plain_step["v_cache"], step["v_cache"])
