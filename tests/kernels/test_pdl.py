"""Programmatic dependent launch (sits.kernels.pdl): when it is on, and that it changes no bit.

CPU: SITS_PDL's parsing, and that no launch asks for PDL off a Hopper GPU or under the interpreter (the
kernels' USE_PDL stays at its default there). GPU (SM 9.0+): a decode-shaped chain of the kernels that take
USE_PDL (fused add + RMSNorm, RoPE + KV write, decode attention and its merge, the small-M GEMM with and
without SiLU·mul, SiLU·mul, greedy argmax), and the fp8 path's (fused add + RMSNorm + e4m3, the direct fp8
GEMM, SiLU·mul + e4m3, per-token e4m3), captured in a CUDA graph without PDL and in each PDL mode, give the
same bits; tests/kernels/test_sm90_compile.py checks that the PDL binaries hold the wait (and the trigger).
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels import pdl
from sits.kernels.argmax import argmax_rows
from sits.kernels.attention_decode import paged_decode_attention
from sits.kernels.fp8_gemm import fp8_gemm
from sits.kernels.fp8_quantize import quantize_fp8_per_token
from sits.kernels.gemm_small_m import small_m_gemm, small_m_gemm_silu_mul
from sits.kernels.quantization import quantize_weight_fp8_per_channel
from sits.kernels.rmsnorm import rms_norm
from sits.kernels.rmsnorm_quant import rms_norm_quant_fp8
from sits.kernels.rope_kv_write import rope_and_cache_write
from sits.kernels.rope_tables import build_cos_sin_cache
from sits.kernels.silu_mul import silu_mul, silu_mul_quant_fp8
from tests.kernels.helpers import DEVICE, ON_GPU


@pytest.mark.parametrize(("value", "mode"), [("1", pdl.PDL_AT_EXIT), ("on", pdl.PDL_AT_EXIT),
                                             ("TRUE", pdl.PDL_AT_EXIT), ("early", pdl.PDL_EARLY), (" Early ", pdl.PDL_EARLY),
                                             ("0", pdl.PDL_OFF), ("", pdl.PDL_OFF), ("off", pdl.PDL_OFF)])
def test_sits_pdl_asks_for_a_mode(monkeypatch, value, mode):
    monkeypatch.setenv(pdl.PDL_ENV, value)
    assert pdl.pdl_mode() == mode
    assert pdl.pdl_requested() is (mode != pdl.PDL_OFF)


@pytest.mark.skipif(ON_GPU, reason="the CPU's answer")
def test_no_launch_asks_for_pdl_on_the_cpu_or_under_the_interpreter(monkeypatch):
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert not pdl.pdl_supported(torch.device("cpu"))
    assert pdl.pdl_launch_options(torch.device("cpu")) == {}
    monkeypatch.delenv(pdl.PDL_ENV)
    assert pdl.pdl_launch_options(torch.device("cpu")) == {}


def _decode_chain(state: dict) -> torch.Tensor:
    """One decode layer's kernels and greedy sampling on `state`'s tensors: next tokens [B] int64."""
    residual = state["residual"]  # the float32 stream, updated in place by both norms
    normed, _ = rms_norm(state["x"], state["norm"], 1e-5, residual=residual, residual_out=residual)
    qkv = small_m_gemm(normed, state["w_qkv"])
    q, k, v = (t.reshape(t.shape[0], -1, 128) for t in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
    q, k = rope_and_cache_write(q, k, v, state["positions"], state["cos_sin"], state["k_cache"], state["v_cache"],
                                state["slots"])
    attn = paged_decode_attention(q, state["k_cache"], state["v_cache"], state["block_tables"], state["seq_lens"],
                                  128**-0.5, max_seq_len=state["max_len"])
    hidden = small_m_gemm(attn.reshape(attn.shape[0], -1), state["w_o"])
    normed, _ = rms_norm(hidden, state["norm"], 1e-5, residual=residual, residual_out=residual)
    up = small_m_gemm_silu_mul(normed, state["w_gate_up"])
    down = small_m_gemm(silu_mul(torch.cat([up, up], dim=-1)), state["w_down"])
    logits = (down.float() @ state["lm_head"].t()).contiguous()
    return argmax_rows(logits)


def _state(batch: int = 4, context: int = 700, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Llama-3-8B's attention and hidden sizes (a narrower MLP and vocabulary), `batch` sequences at `context`."""
    g = torch.Generator(device=device).manual_seed(3)

    def rand(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    blocks_per_seq = (context + 16) // 16 + 1
    k_cache = rand(batch * blocks_per_seq, 16, 8, 128, scale=1.0)
    return {
        "x": rand(batch, 4096, scale=1.0), "residual": rand(batch, 4096, scale=1.0).float(), "norm": rand(4096) + 1,
        "w_qkv": rand(6144, 4096), "w_o": rand(4096, 4096), "w_gate_up": rand(2 * 1024, 4096),
        "w_down": rand(4096, 1024), "lm_head": torch.randn(8192, 4096, generator=g, device=device),
        "k_cache": k_cache, "v_cache": rand(*k_cache.shape, scale=1.0),
        "positions": torch.full((batch,), context, device=device, dtype=torch.int64),
        "slots": torch.arange(batch, device=device, dtype=torch.int64) * blocks_per_seq * 16 + context,
        "block_tables": torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32).view(batch, -1),
        "seq_lens": torch.full((batch,), context + 1, device=device, dtype=torch.int32),
        "cos_sin": build_cos_sin_cache(128, 4096, 500000.0, device=device), "max_len": context + 1,
    }


def _graphed(chain, state: dict, written: tuple[str, ...]) -> torch.Tensor:
    """`chain(state)` warmed up (compiles and autotunes outside the capture), captured, then replayed; the
    tensors the chain writes in place (`written`) are put back after the warm-up."""
    pristine = {name: state[name].clone() for name in written}
    chain(state)
    torch.cuda.synchronize()
    for name in written:
        state[name].copy_(pristine[name])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = chain(state)
    graph.replay()
    torch.cuda.synchronize()
    return result.clone()


def _same_bits_with_and_without_pdl(monkeypatch, make_state, chain, written: tuple[str, ...]) -> None:
    """The chain in a CUDA graph without PDL, then in each PDL mode: the same result and in-place writes."""
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    plain_state = make_state()
    plain = _graphed(chain, plain_state, written)
    for value, mode in (("1", pdl.PDL_AT_EXIT), ("early", pdl.PDL_EARLY)):
        monkeypatch.setenv(pdl.PDL_ENV, value)
        assert pdl.pdl_launch_options(DEVICE) == {"USE_PDL": mode, "launch_pdl": True}
        pdl_state = make_state()
        with_pdl = _graphed(chain, pdl_state, written)
        assert torch.equal(plain, with_pdl), value
        for name in written:  # every in-place write landed the same way
            assert torch.equal(plain_state[name], pdl_state[name]), (value, name)


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and pdl.pdl_supported(DEVICE)), reason="PDL needs SM 9.0 or later")
def test_the_decode_chain_with_pdl_in_a_cuda_graph_gives_the_same_bits(monkeypatch):
    _same_bits_with_and_without_pdl(monkeypatch, _state, _decode_chain, ("k_cache", "v_cache", "residual"))


def _fp8_chain(state: dict) -> torch.Tensor:
    """The fp8 path's kernels that take USE_PDL, in a decode layer's order (the direct GEMM only: the split-K
    kernel adds its partial sums atomically, in no fixed order): the MLP's output [B, 4096] bf16."""
    residual = state["residual"]
    a, a_scale, _ = rms_norm_quant_fp8(state["x"], state["norm"], 1e-5, residual=residual, residual_out=residual)
    gate_up = fp8_gemm(a, a_scale, *state["w_gate_up"])
    h, h_scale = silu_mul_quant_fp8(gate_up)
    out = fp8_gemm(h, h_scale, *state["w_down"])
    again, again_scale = quantize_fp8_per_token(out)
    return fp8_gemm(again, again_scale, *state["w_o"])


def _fp8_state(batch: int = 4) -> dict:
    g = torch.Generator(device="cuda").manual_seed(4)

    def weight(n, k):
        return quantize_weight_fp8_per_channel(torch.randn(n, k, generator=g, device="cuda") * 0.05)

    return {"x": torch.randn(batch, 4096, generator=g, device="cuda").to(torch.bfloat16),
            "residual": torch.randn(batch, 4096, generator=g, device="cuda"),
            "norm": (1 + 0.1 * torch.randn(4096, generator=g, device="cuda")).to(torch.bfloat16),
            "w_gate_up": weight(2 * 2048, 4096), "w_down": weight(4096, 2048), "w_o": weight(4096, 4096)}


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and pdl.pdl_supported(DEVICE)), reason="PDL needs SM 9.0 or later")
def test_the_fp8_chain_with_pdl_in_a_cuda_graph_gives_the_same_bits(monkeypatch):
    _same_bits_with_and_without_pdl(monkeypatch, _fp8_state, _fp8_chain, ("residual",))
