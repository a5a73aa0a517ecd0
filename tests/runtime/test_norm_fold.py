"""The decoder norms folded into the projections at decode batches (runtime/models/norm_fold.py).

The tiny random model with norm weights drawn away from 1, a small-M table naming the Triton kernels at every
bucket (split-K at bucket 1, as the H200's table has it for o_proj and down_proj), the kernels in Triton's
interpreter on CPU (tests/conftest.py). The folded model must compute what the unfolded one computes within bf16
rounding, launch no norm inside its layers at the fold buckets, keep the norm path for larger steps, and stay
unfolded where folding does not apply.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sits.kernels import gemm_small_m, gemm_small_m_splitk
from sits.runtime.engine.kernel_warmup import run_small_m_plan, small_m_layers
from sits.runtime.models.llama import RMSNorm
from sits.runtime.models.norm_fold import FOLD_ENV, fold_buckets, fold_decoder_norms, nearest_pinned
from sits.runtime.models.small_m_linear import SMALL_M_ENV, install_small_m_gemm, installed_table
from tests.runtime.test_small_m_linear import TINY, _forward, _model, _table_file

LAYERS = TINY.num_hidden_layers


def _installed(tmp_path, monkeypatch, dtype=torch.bfloat16, **table):
    """The tiny model with random norm weights and a table installed (`table`: _table_file's options)."""
    model = _model(dtype)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for norm in model.modules():
            if isinstance(norm, RMSNorm):
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=generator) + 0.5)
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model, splitk=frozenset({1}), **table))
    install_small_m_gemm(model, installed_table("cpu"))
    return model


@pytest.fixture
def fold_launches(monkeypatch):
    """Counts the small-M launches by kind: plain, scaled (sumsq given), to the stream (direct and split-K)."""
    counts = {"plain": 0, "scaled": 0, "stream": 0, "splitk stream": 0}
    direct, splitk = gemm_small_m.launch, gemm_small_m_splitk.launch

    def counting_direct(kernel, x, w, out, silu_mul, stream=None, sumsq=None, **meta):
        counts["stream" if stream is not None else "scaled" if sumsq is not None else "plain"] += 1
        return direct(kernel, x, w, out, silu_mul, stream=stream, sumsq=sumsq, **meta)

    def counting_splitk(kernel, x, w, out, counters, stream=None, sumsq=None, **meta):
        counts["splitk stream" if stream is not None else "plain"] += 1
        return splitk(kernel, x, w, out, counters, stream=stream, sumsq=sumsq, **meta)

    monkeypatch.setattr(gemm_small_m, "launch", counting_direct)
    monkeypatch.setattr(gemm_small_m_splitk, "launch", counting_splitk)
    return counts


def _close(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_seqs,tokens_each,stream_kind", [(1, 1, "splitk stream"), (3, 2, "stream")],
                         ids=["m1-splitk", "m6-direct"])
def test_folded_model_matches_the_norm_launches(tmp_path, monkeypatch, fold_launches, dtype, num_seqs, tokens_each,
                                                stream_kind):
    model = _installed(tmp_path, monkeypatch, dtype)
    expected = _forward(model, num_seqs, tokens_each)
    folded = copy.deepcopy(model)
    assert fold_decoder_norms(folded) == frozenset({1, 2, 4, 8, 16, 32, 64}) == folded.fold_buckets
    for counter in fold_launches:
        fold_launches[counter] = 0
    out = _forward(folded, num_seqs, tokens_each)
    # per layer: qkv scaled (the first layer's plain: its input norm starts the stream), o_proj and down_proj
    # into the stream (on the kernel of stream_kind; none on the other), gate_up + SiLU·mul scaled
    expected_launches = {"plain": 1, "scaled": 2 * LAYERS - 1, "stream": 0, "splitk stream": 0}
    expected_launches[stream_kind] = 2 * LAYERS
    assert fold_launches == expected_launches
    _close(out, expected, {torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype])


def test_weights_hold_the_norm_weights_and_the_norms_are_one(tmp_path, monkeypatch):
    model = _installed(tmp_path, monkeypatch)
    before = copy.deepcopy(model)
    fold_decoder_norms(model)
    for old, new in zip(before.model.layers, model.model.layers, strict=True):
        for norm, linear in (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj")):
            g = getattr(old, norm).weight.float()
            w_old, w_new = old.get_submodule(linear).weight, new.get_submodule(linear).weight
            assert torch.equal(w_new, (w_old.float() * g[None, :]).to(w_old.dtype))
            assert torch.equal(getattr(new, norm).weight, torch.ones_like(g).to(w_old.dtype))
        assert torch.equal(new.self_attn.o_proj.weight, old.self_attn.o_proj.weight)
    assert torch.equal(model.model.norm.weight, before.model.norm.weight)  # the final norm stays a launch
    assert "folded norm (stream)" in repr(model.model.layers[0].mlp.down_proj)


def test_steps_past_64_rows_keep_the_norm_path(tmp_path, monkeypatch, fold_launches):
    model = _installed(tmp_path, monkeypatch)
    expected = _forward(model, 8, 9)  # 72 rows: F.linear
    fold_decoder_norms(model)
    out = _forward(model, 8, 9)
    assert fold_launches == {"plain": 0, "scaled": 0, "stream": 0, "splitk stream": 0}
    _close(out, expected, 5e-2)  # the same model, the norm weights now inside the projections


def test_where_folding_does_not_apply(tmp_path, monkeypatch):
    model = _installed(tmp_path, monkeypatch)
    monkeypatch.setenv(FOLD_ENV, "0")
    assert fold_decoder_norms(model) == frozenset() and not model.fold_buckets
    monkeypatch.delenv(FOLD_ENV)
    assert fold_decoder_norms(model) and model.fold_buckets  # then switched off for the next engine: unmarked
    weights = copy.deepcopy(model.state_dict())
    assert fold_decoder_norms(model) == model.fold_buckets  # again: the norms are 1, nothing moves
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())
    monkeypatch.setenv(FOLD_ENV, "off")
    assert fold_decoder_norms(model) == frozenset() == model.fold_buckets
    assert not any(m.fold_buckets or m.fold_role for m in small_m_layers(model))
    monkeypatch.delenv(FOLD_ENV)
    no_silu = _installed(tmp_path, monkeypatch, ops=("linear",))  # gate_up without its fused SiLU·mul
    assert fold_buckets(no_silu) == frozenset()
    half_stream = _installed(tmp_path, monkeypatch)
    half_stream.residual_dtype = None
    assert fold_buckets(half_stream) == frozenset()
    hooked = _installed(tmp_path, monkeypatch)
    hooked.model.layers[1].self_attn.qkv_proj.register_forward_hook(lambda *args: None)  # as a LoRA delta does
    assert fold_buckets(hooked) == frozenset()
    uninstalled = _model(torch.bfloat16)
    before = copy.deepcopy(uninstalled.state_dict())
    assert fold_decoder_norms(uninstalled) == frozenset()  # no table: cuBLAS everywhere, nothing folded
    assert all(torch.equal(before[name], value) for name, value in uninstalled.state_dict().items())


def test_pretune_runs_each_folded_launch(tmp_path, monkeypatch, fold_launches):
    model = _installed(tmp_path, monkeypatch, buckets=(1, 4))
    fold_decoder_norms(model)
    assert len(small_m_layers(model)) == 4
    launched = run_small_m_plan(model, (1, 4))
    # each of the 4 distinct layers at 2 buckets: its plain launch (gate_up: its SiLU·mul) and its folded one
    assert launched == 4 * 2 * 2 + 2  # + gate_up's plain GEMM at both buckets
    assert fold_launches["scaled"] == 2 * 2 and fold_launches["stream"] + fold_launches["splitk stream"] == 2 * 2


def test_nearest_pinned_config():
    pins = {2: {"a": 2}, 32: {"a": 32}}
    assert nearest_pinned(pins, 1) == {"a": 2}
    assert nearest_pinned(pins, 8) == {"a": 2}  # a tie: the smaller bucket
    assert nearest_pinned(pins, 16) == {"a": 32}
    assert nearest_pinned({}, 4) is None


def test_piecewise_steps_fold_as_eager_steps_do(tmp_path, monkeypatch):
    """Steps with prompt tokens through the piecewise graphs' pieces (run eagerly over their static buffers and
    holes on a CPU, captured on a GPU) take the folded path at its buckets and give the eager engine's tokens."""
    from sits.runtime.models.llama import LlamaDecoderLayer
    from tests.runtime.test_triton_backend import WAVES, engine_for, run_schedule, tiny_model

    loaded = tiny_model("triton")
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, loaded.model, splitk=frozenset({1})))
    install_small_m_gemm(loaded.model, installed_table(str(loaded.device)))
    assert fold_decoder_norms(loaded.model)
    expected = run_schedule(engine_for(loaded, max_batched=16), WAVES)
    folded_layers = []
    real = LlamaDecoderLayer.forward_folded
    monkeypatch.setattr(LlamaDecoderLayer, "forward_folded",
                        lambda self, *args: folded_layers.append(args[0].shape[0]) or real(self, *args))
    engine = engine_for(loaded, max_batched=16)
    engine.runner.setup_piecewise_graphs([8, 16], capture=torch.cuda.is_available())
    assert run_schedule(engine, WAVES) == expected
    assert {8, 16} <= set(folded_layers)  # the padded buckets' pieces ran the folded layers
