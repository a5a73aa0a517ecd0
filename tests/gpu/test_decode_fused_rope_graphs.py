"""The fused decode RoPE + KV write captured in a CUDA graph (as decode steps replay it): each replay over new
q / k / v and a moved slot gives the bits of the two launches (rope_and_cache_write, paged_decode_attention)
captured the same way, output and cache, with the split kernel's own merge and without, bf16 and fp8 caches.
Capturing at all shows the fused launch syncs nothing with the host. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.attention_decode import DecodeRope, paged_decode_attention
from sits.kernels.rope_kv_write import build_cos_sin_cache, rope_and_cache_write

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HQ, HKV, D, PAGE, BATCH, CONTEXT = 32, 8, 128, 16, 4, 3000
FP8 = torch.float8_e4m3fn


def _state(cache_dtype: torch.dtype) -> dict:
    device = torch.device("cuda")
    blocks = BATCH * (CONTEXT // PAGE + 2)
    values = torch.randn(2, blocks, PAGE, HKV, D, device=device)
    scales = {}
    if cache_dtype == FP8:
        scales = {"k_scale": torch.full((HKV,), 0.02, device=device), "v_scale": torch.full((HKV,), 0.02, device=device)}
        values = (values / 0.02).clamp(-448, 448)
    return {
        "k_cache": values[0].to(cache_dtype), "v_cache": values[1].to(cache_dtype), "scales": scales,
        "block_tables": torch.randperm(blocks, device=device, dtype=torch.int32).view(BATCH, -1).contiguous(),
        "seq_lens": torch.zeros(BATCH, dtype=torch.int32, device=device),
        "positions": torch.zeros(BATCH, dtype=torch.int64, device=device),
        "slots": torch.full((BATCH,), -1, dtype=torch.int64, device=device),
        "qkv": torch.zeros(BATCH, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device=device),
        "table": build_cos_sin_cache(D, CONTEXT + 64, device=device),
        "counters": torch.zeros(BATCH * HKV, dtype=torch.int32, device=device),
    }  # fmt: skip


def _views(state):
    q, k, v = state["qkv"].split([HQ * D, HKV * D, HKV * D], dim=-1)
    return q.view(BATCH, HQ, D), k.view(BATCH, HKV, D), v.view(BATCH, HKV, D)


def _launch(state, fused: bool, merge: bool) -> torch.Tensor:
    q, k, v = _views(state)
    kwargs = dict(max_seq_len=CONTEXT, split_counters=state["counters"] if merge else None, **state["scales"])
    caches = (state["k_cache"], state["v_cache"])
    if fused:
        rope = DecodeRope(k, v, state["positions"], state["table"], state["slots"])
        return paged_decode_attention(q, *caches, state["block_tables"], state["seq_lens"], 0.08, rope=rope, **kwargs)
    rope_and_cache_write(q, k, v, state["positions"], state["table"], *caches, state["slots"], **state["scales"])
    return paged_decode_attention(q, *caches, state["block_tables"], state["seq_lens"], 0.08, **kwargs)


def _fill(state, seq_lens: list[int], seed: int) -> None:
    """A new step in place: random qkv, the lengths, their positions and slots (-1 for a padding row)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    state["qkv"].copy_(torch.randn(state["qkv"].shape, generator=generator, device="cuda"))
    tables = state["block_tables"].tolist()
    state["seq_lens"].copy_(torch.tensor(seq_lens))
    state["positions"].copy_(torch.tensor([max(n - 1, 0) for n in seq_lens]))
    state["slots"].copy_(torch.tensor([tables[i][(n - 1) // PAGE] * PAGE + (n - 1) % PAGE if n else -1
                                       for i, n in enumerate(seq_lens)]))  # fmt: skip


def _captured(state, fused: bool, merge: bool):
    _fill(state, [CONTEXT] * BATCH, 0)
    _launch(state, fused, merge)  # compiles and autotunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _launch(state, fused, merge)
    return graph, out


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("merge", [False, True], ids=["merge-kernel", "fused-merge"])
def test_replays_match_the_two_launches(cache_dtype, merge):
    torch.manual_seed(0)
    plain, fused = _state(cache_dtype), _state(cache_dtype)
    for name in ("k_cache", "v_cache", "block_tables"):
        fused[name].copy_(plain[name])
    graphs = [_captured(plain, False, merge), _captured(fused, True, merge)]
    for step, seq_lens in enumerate(([17, 2048, 0, 3000], [1, 16, 2999, 0], [2049, 2050, 2051, 2052])):
        for state in (plain, fused):
            _fill(state, seq_lens, step + 1)
        for graph, _ in graphs:
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphs[0][1].view(torch.int16), graphs[1][1].view(torch.int16)), f"step {step}: out"
        for name in ("k_cache", "v_cache"):
            assert torch.equal(plain[name].view(torch.uint8), fused[name].view(torch.uint8)), f"step {step}: {name}"
