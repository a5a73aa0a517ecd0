"""The engine's use of the small-M direct GEMM: DecodeLinear, the measured table and its env override, the
fused gate_up + SiLU·mul, the start-up pre-tune's launches, and the paths that must not change.

On CPU the Triton kernels run through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so an
installed table runs the real kernels on CPU tensors; the model's outputs must match the F.linear path's.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from sits.kernels import gemm_small_m
from sits.kernels.small_m_table import OPS, SmallMTable
from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ConfigError
from sits.runtime.engine.kernel_warmup import run_small_m_plan, small_m_layers
from sits.runtime.engine.tuning_plan import KernelLimits, tuning_plan
from sits.runtime.models.llama import LlamaMLP
from sits.runtime.models.presets import preset_config
from sits.runtime.models.quantize import Fp8SwiGLU, Int8Linear, quantize_model
from sits.runtime.models.random_model import random_loaded_model
from sits.runtime.models.small_m_linear import (
    SMALL_M_ENV,
    DecodeLinear,
    enable_small_m_gemm,
    install_small_m_gemm,
    installed_table,
)

TINY = preset_config("tiny")  # 2 layers, hidden 64, 4 heads / 2 KV heads of 16, MLP 128
BLOCK_SIZE = 8
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PROJECTIONS = 4  # qkv_proj, o_proj, gate_up_proj, down_proj per layer


def _model(dtype: torch.dtype):
    return random_loaded_model(TINY, TorchAttentionBackend(), "cpu", dtype, seed=5).model


def _table_file(tmp_path, model: nn.Module, ops=OPS, buckets=BUCKETS, device: str = "",
                splitk: frozenset[int] = frozenset()) -> str:
    """A table naming the direct kernel the winner at every projection shape of `model` and bucket (the split-K
    one at the `splitk` buckets of op linear)."""
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, DecodeLinear)}
    gate_up = model.model.layers[0].mlp.gate_up_proj
    entries = [{"op": "linear", "n": n, "k": k, "m_bucket": b, "winner": "splitk" if b in splitk else "direct"}
               for n, k in sorted(shapes) for b in buckets if "linear" in ops]
    entries += [{"op": "silu_mul", "n": gate_up.out_features, "k": gate_up.in_features, "m_bucket": b,
                 "winner": "direct"} for b in buckets if "silu_mul" in ops]
    path = tmp_path / "small_m_gemm_table.json"
    path.write_text(json.dumps({"version": 1, "device": device, "entries": entries}))
    return str(path)


PINNED = {"BLOCK_N": 32, "BLOCK_K": 32, "SWAP_AB": 0, "num_warps": 4, "num_stages": 1}


def _pinned_table_file(tmp_path, model: nn.Module) -> str:
    """`_table_file` at bucket 4 with every entry pinned to PINNED: o_proj's plain GEMM on split-K (2 splits,
    swapped), the rest on the direct kernel."""
    with open(_table_file(tmp_path, model, buckets=(4,))) as f:
        table = json.load(f)
    for entry in table["entries"]:
        o_proj = (entry["n"], entry["k"]) == (TINY.hidden_size, TINY.hidden_size)
        entry["winner"] = "splitk" if o_proj and entry["op"] == "linear" else "direct"
        entry["config"] = PINNED | ({"SPLIT_K": 2, "SWAP_AB": 1} if entry["winner"] == "splitk" else {})
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps(table))
    return str(path)


def _forward(model, num_seqs: int, tokens_each: int) -> torch.Tensor:
    """The model over num_seqs prompts of tokens_each tokens (num_seqs * tokens_each rows), fresh caches."""
    rows = num_seqs * tokens_each
    generator = torch.Generator().manual_seed(rows)
    input_ids = torch.randint(3, TINY.vocab_size, (rows,), generator=generator)
    positions = torch.arange(tokens_each).repeat(num_seqs)
    blocks = -(-tokens_each // BLOCK_SIZE)
    tables = torch.arange(num_seqs * blocks, dtype=torch.int32).view(num_seqs, blocks)
    slots = (tables[:, :1].long() * BLOCK_SIZE + torch.arange(tokens_each)).reshape(-1)
    metadata = AttentionMetadata(
        num_prefills=num_seqs, num_prefill_tokens=rows, num_decodes=0, slot_mapping=slots,
        query_start_loc=torch.arange(0, rows + 1, tokens_each, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), tokens_each, dtype=torch.int32), block_tables=tables,
        max_query_len=tokens_each, max_seq_len=tokens_each, seq_lens_list=[tokens_each] * num_seqs,
        query_lens_list=[tokens_each] * num_seqs,
    )  # fmt: skip
    dtype = model.model.embed_tokens.weight.dtype
    shape = model.kv_cache_shape(num_seqs * blocks, BLOCK_SIZE)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.model.layers]
    with torch.no_grad():
        return model(input_ids, positions, caches, metadata)


@pytest.fixture
def launches(monkeypatch):
    """Counts the direct kernel's launches: [plain, fused]."""
    counts = [0, 0]
    real = gemm_small_m.launch

    def counting(kernel, x, w, out, silu_mul, **meta):
        counts[silu_mul] += 1
        return real(kernel, x, w, out, silu_mul, **meta)

    monkeypatch.setattr(gemm_small_m, "launch", counting)
    return counts


def test_uninstalled_layers_are_nn_linear():
    """Without a table the projections are nn.Linear and compute F.linear exactly (cuBLAS on CUDA)."""
    model = _model(torch.float32)
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, DecodeLinear) and isinstance(linear, nn.Linear)
        assert not linear.direct_buckets and not linear.silu_mul_buckets
        x = torch.randn(3, linear.in_features)
        assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert layer.mlp.gate_up_proj.gated and not layer.mlp.down_proj.gated


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_seqs,tokens_each", [(1, 1), (3, 4), (5, 7)], ids=["m1", "m12", "m35"])
def test_model_with_a_table_matches_the_cublas_path(tmp_path, monkeypatch, launches, dtype, num_seqs, tokens_each):
    model = _model(dtype)
    expected = _forward(model, num_seqs, tokens_each)
    assert launches == [0, 0]
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model))
    assert install_small_m_gemm(model, installed_table("cpu")) == PROJECTIONS * TINY.num_hidden_layers
    out = _forward(model, num_seqs, tokens_each)
    layers = TINY.num_hidden_layers
    assert launches == [3 * layers, layers]  # qkv, o and down plain; gate_up with its SiLU·mul fused
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol * scale, rtol=tol)


def test_split_k_buckets_run_the_split_k_kernel_with_the_layers_counters(tmp_path, monkeypatch, launches):
    """A table whose bucket 16 names the split-K kernel: calls of 9 to 16 rows run it (with each layer's own
    counters, zero again after every launch), the others the direct kernel; outputs match F.linear's."""
    from sits.kernels import gemm_small_m_splitk

    model = _model(torch.float16)
    expected = {rows: _forward(model, 1, rows) for rows in (3, 12)}
    splitk_calls = []
    real = gemm_small_m_splitk.launch

    def counting(kernel, x, w, out, counters, **meta):
        splitk_calls.append(counters)
        return real(kernel, x, w, out, counters, **meta)

    monkeypatch.setattr(gemm_small_m_splitk, "launch", counting)
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model, ops=("linear",), splitk=frozenset({16})))
    install_small_m_gemm(model, installed_table("cpu"))
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.splitk_buckets == {16} and o_proj.splitk_counters is not None
    assert "split-K at [16]" in repr(o_proj)
    for rows, reference in expected.items():
        out = _forward(model, 1, rows)
        scale = reference.float().abs().max().item()
        torch.testing.assert_close(out.float(), reference.float(), atol=1e-2 * scale, rtol=1e-2)
    layers = TINY.num_hidden_layers
    assert launches == [PROJECTIONS * layers, 0]  # the 3-row forward: all four on the direct kernel
    assert len(splitk_calls) == PROJECTIONS * layers  # the 12-row forward: all four split-K
    assert len({id(c) for c in splitk_calls}) == PROJECTIONS * layers  # each layer its own counters
    assert all(c.count_nonzero().item() == 0 for c in splitk_calls)


def test_pinned_configs_are_launched_as_the_table_says(tmp_path, monkeypatch):
    """Entries with a pinned config launch the raw kernel with it (no autotuning): the plain GEMM, the split-K one
    and the fused SiLU·mul, each at its bucket; the outputs still match F.linear's."""
    from sits.kernels import gemm_small_m_splitk

    model = _model(torch.float16)
    expected = _forward(model, 1, 3)
    path = _pinned_table_file(tmp_path, model)
    seen = []
    for module, name in ((gemm_small_m, "launch"), (gemm_small_m_splitk, "launch")):
        real = getattr(module, name)

        def recording(kernel, *args, _real=real, **meta):
            seen.append((getattr(kernel, "fn", kernel).__name__, meta.get("SPLIT_K"), meta.get("BLOCK_N")))
            return _real(kernel, *args, **meta)

        monkeypatch.setattr(module, name, recording)
    monkeypatch.setenv(SMALL_M_ENV, path)
    install_small_m_gemm(model, installed_table("cpu"))
    assert model.model.layers[0].self_attn.o_proj.pinned == {4: PINNED | {"SPLIT_K": 2, "SWAP_AB": 1}}
    out = _forward(model, 1, 3)
    layers = TINY.num_hidden_layers
    assert sorted(set(seen)) == [("_small_m_gemm_kernel", None, 32), ("_splitk_kernel", 2, 32)]
    assert len(seen) == PROJECTIONS * layers
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2 * scale, rtol=1e-2)


def test_float32_activations_run_the_tables_kernels_autotuned(tmp_path, monkeypatch):
    """--activation-dtype float32 beside fp16 weights, the table of the test above (pinned configs at bucket 4,
    o_proj on split-K): every projection takes its float32 rows on the table's kernel, the gate_up with its
    SiLU·mul, each autotuned (the pins are for half-precision rows), writing float32; the model's output is
    mixed_linear's (the uninstalled path) to float32 accuracy."""
    from sits.kernels import gemm_small_m_splitk

    model = _model(torch.float16)
    model.use_activation_dtype(torch.float32)
    expected = _forward(model, 1, 3)
    path = _pinned_table_file(tmp_path, model)
    seen = []
    for module in (gemm_small_m, gemm_small_m_splitk):
        real = module.launch

        def recording(kernel, x, w, out, *args, _real=real, _module=module, **meta):
            seen.append((_module.__name__.rsplit(".", 1)[1], type(kernel).__name__, x.dtype, out.dtype))
            return _real(kernel, x, w, out, *args, **meta)

        monkeypatch.setattr(module, "launch", recording)
    monkeypatch.setenv(SMALL_M_ENV, path)
    install_small_m_gemm(model, installed_table("cpu"))
    out = _forward(model, 1, 3)
    layers = TINY.num_hidden_layers
    assert sorted(set(seen)) == [("gemm_small_m", "Autotuner", torch.float32, torch.float32),
                                 ("gemm_small_m_splitk", "Autotuner", torch.float32, torch.float32)]
    assert len(seen) == PROJECTIONS * layers
    assert out.dtype == torch.float32  # the final norm too writes float32
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-3 * scale, rtol=1e-3)


def test_only_the_tables_buckets_and_ops_run_direct(tmp_path, monkeypatch, launches):
    model = _model(torch.float16)
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model, ops=("linear",), buckets=(4,)))
    install_small_m_gemm(model, installed_table("cpu"))
    _forward(model, 1, 2)  # bucket 2: not in the table
    assert launches == [0, 0]
    _forward(model, 1, 3)  # bucket 4: every projection plain (no silu_mul entry)
    assert launches == [PROJECTIONS * TINY.num_hidden_layers, 0]
    launches[:] = [0, 0]
    _forward(model, 5, 15)  # 75 rows: above the kernel's batches
    assert launches == [0, 0]


def test_a_hooked_gate_up_is_not_fused(tmp_path, monkeypatch, launches):
    """A forward hook on gate_up_proj (a LoRA delta) needs its output: the GEMM runs unfused, the hook runs."""
    model = _model(torch.float16)
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model))
    install_small_m_gemm(model, installed_table("cpu"))
    seen = []
    for layer in model.model.layers:
        layer.mlp.gate_up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    _forward(model, 1, 2)
    assert launches == [PROJECTIONS * TINY.num_hidden_layers, 0]
    assert seen == [torch.Size([2, 2 * TINY.intermediate_size])] * TINY.num_hidden_layers


def test_env_override(tmp_path, monkeypatch):
    model = _model(torch.float16)
    monkeypatch.setenv(SMALL_M_ENV, "off")
    assert installed_table("NVIDIA H200").entries == {}
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model, device="NVIDIA H200"))
    assert installed_table("NVIDIA H200").entries and installed_table("NVIDIA H100 80GB HBM3").entries == {}
    monkeypatch.setenv(SMALL_M_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match=r"SITS_SMALL_M_GEMM=.*missing.json: no such file"):
        installed_table("NVIDIA H200")
    (tmp_path / "bad.json").write_text('{"version": 1, "entries": [{"op": "linear"}]}')
    monkeypatch.setenv(SMALL_M_ENV, str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="bad small-M GEMM table entry"):
        installed_table("NVIDIA H200")
    monkeypatch.delenv(SMALL_M_ENV)
    shipped = installed_table("NVIDIA H200")  # unset: the committed table, measured on that GPU only
    assert shipped.entries and installed_table("NVIDIA H100 80GB HBM3").entries == {}


def test_not_enabled_off_cuda_and_float32_layers_keep_f_linear(tmp_path, monkeypatch):
    model = _model(torch.float16)
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model))
    assert enable_small_m_gemm(model, torch.device("cpu")) == 0
    assert not small_m_layers(model)
    full = _model(torch.float32)
    assert install_small_m_gemm(full, installed_table("cpu")) == 0


def test_pretune_launches_every_bucket_of_each_distinct_layer(tmp_path, monkeypatch, launches):
    model = _model(torch.float16)
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model, buckets=(1, 4, 64)))
    install_small_m_gemm(model, installed_table("cpu"))
    limits = KernelLimits(max_num_batched_tokens=40, max_num_seqs=8, max_model_len=64, block_size=BLOCK_SIZE,
                          num_kv_heads=2, num_sms=8, cache_tokens=512)
    rows = tuning_plan(limits).small_m_rows
    assert rows == (1, 2, 4, 8, 16, 32, 40)
    distinct = small_m_layers(model)
    assert len(distinct) == PROJECTIONS  # the layers repeat the same four shapes
    # buckets 1, 4 and 64 (reached by 1, 4 and 40 rows): each distinct layer plain, gate_up fused as well
    assert run_small_m_plan(model, rows) == PROJECTIONS * 3 + 3
    assert launches == [PROJECTIONS * 3, 3]


def test_pretune_with_float32_activations_launches_float32_rows(tmp_path, monkeypatch):
    """With --activation-dtype float32 the pre-tune's plain and SiLU·mul launches take float32 rows, the keys the
    model's steps reach (a CUDA graph's capture cannot autotune)."""
    model = _model(torch.float16)
    model.use_activation_dtype(torch.float32)
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, model, buckets=(1, 4)))
    install_small_m_gemm(model, installed_table("cpu"))
    dtypes = []
    real = gemm_small_m.launch

    def recording(kernel, x, w, out, silu_mul, **meta):
        dtypes.append((x.dtype, out.dtype, silu_mul))
        return real(kernel, x, w, out, silu_mul, **meta)

    monkeypatch.setattr(gemm_small_m, "launch", recording)
    assert run_small_m_plan(model, (1, 3)) == PROJECTIONS * 2 + 2
    assert set(dtypes) == {(torch.float32, torch.float32, False), (torch.float32, torch.float32, True)}


def test_quantized_models_are_unchanged():
    """fp8 / int8 conversion still replaces the projections (and fp8 w8a8 still fuses its MLP)."""
    model = _model(torch.float32)
    assert quantize_model(model, "int8") == PROJECTIONS * TINY.num_hidden_layers
    assert all(isinstance(layer.mlp.down_proj, Int8Linear) for layer in model.model.layers)
    model = _model(torch.float32)
    quantize_model(model, "fp8")
    assert all(isinstance(layer.mlp, Fp8SwiGLU) for layer in model.model.layers)
    assert not any(isinstance(m, LlamaMLP) for m in model.modules())
    assert install_small_m_gemm(model, SmallMTable()) == 0


def test_tensor_parallel_shards_are_left_alone():
    """A model holding row-parallel shards (tensor parallelism) keeps F.linear: the ranks stay alike."""
    from sits.runtime.models import small_m_linear
    from sits.runtime.parallel.layers import RowParallelLinear

    model = _model(torch.float16)
    assert not small_m_linear._sharded(model)
    layer = model.model.layers[0].self_attn
    layer.o_proj = RowParallelLinear(layer.o_proj.weight.detach().clone(), None)
    assert small_m_linear._sharded(model)
