"""The decoder norms fused into the small-M GEMM in the engine: LlamaDecoderLayer runs input_layernorm +
qkv_proj and post_attention_layernorm + gate_up_proj + SiLU·mul as one launch each where the measured
table's "norm_linear" / "norm_silu_mul" entries say so, with the Triton norm only; everything else as before.

On CPU the kernels run through Triton's interpreter (tests/conftest.py), where the fused launch equals the
Triton norm followed by the direct kernel bit for bit; against the cuBLAS (F.linear) path the outputs agree
within the half-precision tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch

from sits.kernels import gemm_small_m, gemm_small_m_norm
from sits.kernels.small_m_table import OPS
from sits.runtime.engine.kernel_warmup import run_small_m_plan, small_m_layers
from sits.runtime.models.kernel_ops import TORCH_OPS, TritonKernelOps
from sits.runtime.models.llama import RMSNorm
from sits.runtime.models.small_m_linear import (
    SMALL_M_ENV,
    DecodeLinear,
    install_small_m_gemm,
    installed_table,
)
from tests.runtime.test_small_m_linear import TINY, _forward, _model

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
NORM_BUCKETS = (1, 2, 4, 8)
LAYERS = TINY.num_hidden_layers


def _table_file(tmp_path, model, ops=OPS, norm_buckets=NORM_BUCKETS) -> str:
    """The direct kernel the winner of every op at every projection shape of `model` (norm ops: qkv_proj's
    shape for norm_linear, gate_up_proj's for norm_silu_mul, at `norm_buckets`)."""
    layer = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, DecodeLinear)}
    rows = [("linear", n, k, b) for n, k in sorted(shapes) for b in BUCKETS]
    rows += [("silu_mul", gate_up.out_features, gate_up.in_features, b) for b in BUCKETS]
    rows += [("norm_linear", qkv.out_features, qkv.in_features, b) for b in norm_buckets]
    rows += [("norm_silu_mul", gate_up.out_features, gate_up.in_features, b) for b in norm_buckets]
    entries = [{"op": op, "n": n, "k": k, "m_bucket": b, "winner": "direct"} for op, n, k, b in rows if op in ops]
    path = tmp_path / f"table-{len(entries)}.json"
    path.write_text(json.dumps({"version": 1, "device": "", "entries": entries}))
    return str(path)


def _triton_norms(model, ops=None):
    """The Triton norms and SiLU·mul (what the Triton attention back end brings), on the CPU interpreter."""
    ops = ops or TritonKernelOps()
    for module in model.modules():
        if isinstance(module, RMSNorm) or hasattr(module, "ops"):
            module.ops = ops
    return model


def _install(monkeypatch, model, path: str) -> int:
    monkeypatch.setenv(SMALL_M_ENV, path)
    return install_small_m_gemm(model, installed_table("cpu"))


@pytest.fixture
def launches(monkeypatch):
    """Counts the launches: {"gemm": [plain, silu], "norm": [plain, silu]}."""
    counts = {"gemm": [0, 0], "norm": [0, 0]}
    real_gemm, real_norm = gemm_small_m.launch, gemm_small_m_norm.launch

    def gemm(kernel, x, w, out, silu_mul, **meta):
        counts["gemm"][silu_mul] += 1
        return real_gemm(kernel, x, w, out, silu_mul, **meta)

    def norm(kernel, x, residual, norm_weight, eps, w, out, residual_out, silu_mul, **meta):
        counts["norm"][silu_mul] += 1
        return real_norm(kernel, x, residual, norm_weight, eps, w, out, residual_out, silu_mul, **meta)

    monkeypatch.setattr(gemm_small_m, "launch", gemm)
    monkeypatch.setattr(gemm_small_m_norm, "launch", norm)
    return counts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_seqs,tokens_each", [(1, 1), (3, 1), (2, 4)], ids=["m1", "m3", "m8"])
def test_fused_norms_match_the_unfused_paths(tmp_path, monkeypatch, launches, dtype, num_seqs, tokens_each):
    model = _triton_norms(_model(dtype))
    cublas = _forward(model, num_seqs, tokens_each)
    _install(monkeypatch, model, _table_file(tmp_path, model, ops=("linear", "silu_mul")))
    unfused = _forward(model, num_seqs, tokens_each)
    assert launches["norm"] == [0, 0]
    launches["gemm"][:] = [0, 0]
    assert _install(monkeypatch, model, _table_file(tmp_path, model)) == 4 * LAYERS
    fused = _forward(model, num_seqs, tokens_each)
    # each layer: norm + qkv and norm + gate_up + SiLU·mul fused; o and down plain on the direct kernel
    assert launches == {"gemm": [2 * LAYERS, 0], "norm": [LAYERS, LAYERS]}
    assert torch.equal(fused, unfused)  # the interpreter: the fused launch is the unfused path bit for bit
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    scale = cublas.float().abs().max().item()
    torch.testing.assert_close(fused.float(), cublas.float(), atol=tol * scale, rtol=tol)


def test_stream_in_the_model_dtype(tmp_path, monkeypatch, launches):
    """residual_dtype None: the stream stays in the model dtype (the first layer's is the embedding rows)."""
    model = _triton_norms(_model(torch.float16))
    model.residual_dtype = None
    _install(monkeypatch, model, _table_file(tmp_path, model, ops=("linear", "silu_mul")))
    unfused = _forward(model, 1, 2)
    _install(monkeypatch, model, _table_file(tmp_path, model))
    assert torch.equal(_forward(model, 1, 2), unfused)
    assert launches["norm"] == [LAYERS, LAYERS]


def test_only_the_norm_buckets_fuse(tmp_path, monkeypatch, launches):
    model = _triton_norms(_model(torch.float16))
    _install(monkeypatch, model, _table_file(tmp_path, model, norm_buckets=(4,)))
    _forward(model, 1, 2)  # bucket 2: the norm runs alone, then the direct kernels
    assert launches == {"gemm": [3 * LAYERS, LAYERS], "norm": [0, 0]}
    _forward(model, 3, 1)  # bucket 4: fused
    assert launches["norm"] == [LAYERS, LAYERS]
    _forward(model, 2, 8)  # 16 rows: past the fused norm's batches
    assert launches["norm"] == [LAYERS, LAYERS]


def test_torch_back_end_and_hooked_projections_do_not_fuse(tmp_path, monkeypatch, launches):
    """The torch norms never fuse; a hook (a LoRA delta) on qkv_proj or gate_up_proj keeps its norm apart."""
    model = _model(torch.float16)
    assert all(layer.input_layernorm.ops is TORCH_OPS for layer in model.model.layers)
    _install(monkeypatch, model, _table_file(tmp_path, model))
    _forward(model, 1, 1)
    assert launches["norm"] == [0, 0]
    _triton_norms(model)
    seen = []
    for layer in model.model.layers:
        layer.self_attn.qkv_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    _forward(model, 1, 1)
    assert launches["norm"] == [0, LAYERS] and len(seen) == LAYERS


def test_install_limits_and_pretune(tmp_path, monkeypatch, launches):
    model = _triton_norms(_model(torch.float16))
    _install(monkeypatch, model, _table_file(tmp_path, model))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.norm_buckets == set(NORM_BUCKETS)
    assert layer.mlp.gate_up_proj.norm_silu_mul_buckets == set(NORM_BUCKETS)
    assert not layer.mlp.gate_up_proj.norm_buckets and not layer.self_attn.o_proj.norm_buckets
    assert len(small_m_layers(model)) == 4
    # rows 1, 2, 4, 8, 16: each distinct layer plain at all 5 buckets, gate_up's SiLU·mul at all 5; the fused
    # norm at buckets 1 to 8: qkv with and without a residual stream (2 each), gate_up + SiLU·mul once
    assert run_small_m_plan(model, (1, 2, 4, 8, 16)) == 4 * 5 + 5 + 4 * 3
    assert launches["norm"] == [8, 4]
    with_bias = _model(torch.float16)
    for module in with_bias.modules():
        if isinstance(module, DecodeLinear):
            module.bias = torch.nn.Parameter(torch.zeros(module.out_features, dtype=torch.float16))
    _install(monkeypatch, with_bias, _table_file(tmp_path, with_bias))
    assert not any(m.norm_buckets or m.norm_silu_mul_buckets for m in with_bias.modules() if isinstance(m, DecodeLinear))
