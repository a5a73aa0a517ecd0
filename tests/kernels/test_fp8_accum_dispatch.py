"""The fp8 GEMM's dispatch to the backend a measured table chose: fp8_gemm_on, and Fp8Linear per M bucket.

On the CPU the Triton kernel runs through the interpreter and torch._scaled_mm cannot run, so the
scaled_mm backends must fall back to the precise Triton kernel, and the quantized model keeps its
reference path whatever the table says. The GPU cases check torch._scaled_mm itself, its fallback on
operands it cannot take, and a CUDA graph replaying the chosen backend.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from sits.kernels.fp8_accum import (
    BACKENDS,
    MAX_FAST_ERROR,
    AccumEntry,
    AccumTable,
    choose_backend,
    load_accum_table,
)
from sits.kernels.fp8_gemm import (
    fp8_gemm,
    fp8_gemm_on,
    fp8_gemm_reference,
    fp8_gemm_scaled_mm,
    quantize_weight_fp8_per_channel,
    scaled_mm_runs,
    scaled_mm_usable,
)
from sits.kernels.fp8_quantize import quantize_fp8_per_token_reference
from sits.runtime.models.quantize import Fp8Linear, Fp8SwiGLU, quantize_model
from tests.kernels.helpers import DEVICE, ON_GPU, randn
from tests.runtime.test_quantize import TINY, all_logits, tiny

FP8_TENSOR_CORES = ON_GPU and torch.cuda.get_device_capability() >= (8, 9)


def _operands(m: int, n: int, k: int):
    a_fp8, a_scale = quantize_fp8_per_token_reference(randn(m, k, scale=2.0))
    w_fp8, w_scale = quantize_weight_fp8_per_channel(randn(n, k, scale=0.05))
    return a_fp8, a_scale, w_fp8, w_scale


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.skipif(ON_GPU, reason="the CPU's fallback; the GPU runs torch._scaled_mm (below)")
def test_every_backend_runs_the_triton_kernel_where_scaled_mm_cannot():
    a_fp8, a_scale, w_fp8, w_scale = _operands(5, 32, 64)
    assert not scaled_mm_usable(a_fp8, a_scale, w_fp8, w_scale, torch.bfloat16)  # no CUDA tensors
    assert not scaled_mm_runs(torch.device("cpu"))
    precise = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32)
    expected = fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32)
    assert _relative(precise, expected) < 1e-5
    for backend in ("scaled_mm", "scaled_mm_fast"):
        torch.testing.assert_close(fp8_gemm_on(backend, a_fp8, a_scale, w_fp8, w_scale, torch.float32), precise,
                                   rtol=0, atol=0)
    assert _relative(fp8_gemm_on("triton_fast", a_fp8, a_scale, w_fp8, w_scale, torch.float32), expected) < 1e-5


@pytest.mark.parametrize("m", [1, 5, 33])
def test_the_scaled_mm_call_passes_the_weight_transposed_and_the_scales_rowwise(m):
    """torch._scaled_mm's own CPU kernel (or the GPU's) on fp8_gemm's operands: the same product."""
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, 48, 64)
    expected = fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32)
    for scale in (w_scale, w_scale.reshape(-1, 1)):  # [N] or [N, 1], as fp8_gemm takes it
        for fast in (False, True):
            out = fp8_gemm_scaled_mm(a_fp8, a_scale, w_fp8, scale, fast_accum=fast)
            assert out.dtype == torch.bfloat16 and out.shape == (m, 48)
            assert _relative(out, expected) < 5e-3  # bf16 rounding (and fast sums over K = 64)
    if not ON_GPU:  # a float32 output: the sums' own error
        assert _relative(fp8_gemm_scaled_mm(a_fp8, a_scale, w_fp8, w_scale, torch.float32), expected) < 1e-5


def test_an_unknown_backend_is_refused():
    a_fp8, a_scale, w_fp8, w_scale = _operands(2, 16, 32)
    with pytest.raises(ValueError, match="fp8 GEMM backend must be one of triton, scaled_mm"):
        fp8_gemm_on("cublas", a_fp8, a_scale, w_fp8, w_scale)


def _tiny_table(device: str = "NVIDIA H200") -> AccumTable:
    """TINY's gate_up [768, 128]: triton from 16 rows, scaled_mm from 64, fast sums from 1,024; down [128, 384]: one step."""
    errors = {"triton": 1e-7, "scaled_mm": 1e-7, "triton_fast": 1e-4, "scaled_mm_fast": 1e-4}
    rows = [AccumEntry.measured(16, 768, 128, {"triton": 0.010, "scaled_mm": 0.012}, errors),
            AccumEntry.measured(64, 768, 128, {"triton": 0.020, "scaled_mm": 0.015}, errors),
            AccumEntry.measured(1024, 768, 128, {"triton": 0.10, "scaled_mm": 0.08, "scaled_mm_fast": 0.06}, errors),
            AccumEntry.measured(256, 128, 384, {"triton": 0.02, "triton_fast": 0.01}, errors)]
    return AccumTable(device, {(e.m_bucket, e.n, e.k): e for e in rows})


def test_fp8_linear_takes_the_backend_of_each_calls_m_bucket_from_an_installed_table(tmp_path, caplog):
    path = tmp_path / "fp8_accum_table.json"
    path.write_text(_tiny_table().to_json())
    table = load_accum_table(path, device_name="NVIDIA H200")
    model = tiny().model
    with caplog.at_level(logging.INFO, logger="sits.runtime.models.quantize"):
        assert quantize_model(model, "fp8", fp8_mode="w8a8", accum=table) == 2 * 4
    assert "GEMM backends: measured table of NVIDIA H200: triton 1, scaled_mm 1, triton_fast 1, scaled_mm_fast 1 " \
           "of 4 shapes" in caplog.text
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, Fp8SwiGLU)
    gate_up, down = mlp.gate_up_proj, mlp.down_proj  # down runs through forward_quantized
    assert gate_up.gemm_steps == ((16, "triton"), (64, "scaled_mm"), (1024, "scaled_mm_fast"))
    picks = {m: gate_up.backend_for(m) for m in (1, 16, 17, 40, 64, 65, 448, 1024, 1025, 16384)}
    # M rounds up to its bucket (17 -> 32, 40 -> 64), then takes the largest measured bucket at or below it
    assert picks == {1: "triton", 16: "triton", 17: "triton", 40: "scaled_mm", 64: "scaled_mm", 65: "scaled_mm",
                     448: "scaled_mm", 1024: "scaled_mm_fast", 1025: "scaled_mm_fast", 16384: "scaled_mm_fast"}
    assert {down.backend_for(m) for m in (1, 256, 5000)} == {"triton_fast"}
    assert "GEMM backend per M bucket {16: triton, 64: scaled_mm, 1024: scaled_mm_fast}" in repr(gate_up)
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj.gemm_steps == () and attention.qkv_proj.backend_for(448) == "triton"  # not measured


def test_the_gemm_table_env_turns_the_table_off_or_names_another(tmp_path, monkeypatch):
    """SITS_FP8_GEMM_TABLE: 'off' gives the default rule, a path that table, a missing file one clear error."""
    from sits.runtime.config import ConfigError
    from sits.runtime.models.quantize import GEMM_TABLE_ENV, _installed_table

    path = tmp_path / "other.json"
    path.write_text(_tiny_table().to_json())
    monkeypatch.setenv(GEMM_TABLE_ENV, str(path))
    assert _installed_table("NVIDIA H200").backend(448, 768, 128) == "scaled_mm"
    assert _installed_table("NVIDIA A100").backend(448, 768, 128) == "triton"  # another GPU's table applies nowhere
    monkeypatch.setenv(GEMM_TABLE_ENV, "off")
    assert _installed_table("NVIDIA H200").backends_used() == set()
    monkeypatch.setenv(GEMM_TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match=r"SITS_FP8_GEMM_TABLE=.*missing.json: no such file"):
        _installed_table("NVIDIA H200")


def test_the_cpu_reference_path_ignores_the_table():
    tokens = [(3 * i + 1) % TINY.vocab_size for i in range(70)]  # 70 rows: gate_up at the scaled_mm step
    base = tiny().model
    with_table, without = copy.deepcopy(base), copy.deepcopy(base)
    quantize_model(with_table, "fp8", fp8_mode="w8a8", accum=_tiny_table())
    quantize_model(without, "fp8", fp8_mode="w8a8")
    assert with_table.model.layers[0].mlp.gate_up_proj.backend_for(len(tokens)) == "scaled_mm"
    torch.testing.assert_close(all_logits(with_table, tokens), all_logits(without, tokens), rtol=0, atol=0)


def test_weight_only_layers_have_no_gemm_steps():
    linear = torch.nn.Linear(128, 768)
    assert Fp8Linear.from_linear(linear, weight_only=True, accum=_tiny_table()).gemm_steps == ()
    assert Fp8Linear.from_linear(linear, accum=_tiny_table()).gemm_steps != ()


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_TENSOR_CORES, reason="needs fp8 tensor cores")
@pytest.mark.parametrize("m", [1, 3, 100, 448, 1000])
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_matches_the_reference_on_the_gpu(backend, m):
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, 256, 512)
    out = fp8_gemm_on(backend, a_fp8, a_scale, w_fp8, w_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, 256)
    assert _relative(out, fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, torch.float32)) < 5e-3
    if backend.startswith("scaled_mm"):  # really torch._scaled_mm: its deterministic result, bit for bit
        assert scaled_mm_usable(a_fp8, a_scale, w_fp8, w_scale, torch.bfloat16)
        expected = fp8_gemm_scaled_mm(a_fp8, a_scale, w_fp8, w_scale, fast_accum=backend == "scaled_mm_fast")
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_TENSOR_CORES, reason="needs fp8 tensor cores")
def test_operands_scaled_mm_cannot_take_fall_back_to_precise_triton_on_the_gpu():
    assert scaled_mm_runs(DEVICE)
    a_fp8, a_scale, w_fp8, w_scale = _operands(200, 256, 512)
    buffer = torch.empty(a_fp8.numel() + 8, dtype=torch.float8_e4m3fn, device=DEVICE)
    shifted = buffer[8:].view(200, 512)  # 8 bytes off a 16-byte boundary
    shifted.copy_(a_fp8)
    cases = {"misaligned activation": (shifted, a_scale, w_fp8, w_scale, torch.bfloat16),
             "float16 output": (a_fp8, a_scale, w_fp8, w_scale, torch.float16),
             "N not a multiple of 16": (a_fp8, a_scale, w_fp8[:250], w_scale[:250], torch.bfloat16)}
    for name, (a, sa, w, sw, out_dtype) in cases.items():
        assert not scaled_mm_usable(a, sa, w, sw, out_dtype), name
        out = fp8_gemm_on("scaled_mm_fast", a, sa, w, sw, out_dtype)
        torch.testing.assert_close(out, fp8_gemm(a, sa, w, sw, out_dtype=out_dtype), rtol=0, atol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_TENSOR_CORES, reason="needs fp8 tensor cores")
def test_a_cuda_graph_replays_the_chosen_backend():
    torch.manual_seed(0)
    table = AccumTable("any", {(512, 768, 128): AccumEntry(512, 768, 128, "scaled_mm")})
    layer = Fp8Linear.from_linear(torch.nn.Linear(128, 768, device=DEVICE, dtype=torch.bfloat16), accum=table)
    static = torch.randn(448, 128, device=DEVICE, dtype=torch.bfloat16)
    assert layer.backend_for(448) == "scaled_mm"
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(static)
        static.copy_(torch.randn(448, 128, device=DEVICE, dtype=torch.bfloat16))
        graph.replay()
        torch.testing.assert_close(captured, layer(static), rtol=0, atol=0)


def test_the_committed_table_if_any_is_valid():
    from sits.kernels.fp8_accum import DEFAULT_TABLE_PATH

    if not DEFAULT_TABLE_PATH.is_file():
        pytest.skip("no measured table installed")
    table = load_accum_table(DEFAULT_TABLE_PATH)
    assert table.device and table.entries
    assert json.loads(DEFAULT_TABLE_PATH.read_text())["version"] == 2
    for entry in table.entries.values():  # each choice is the rule's on the figures beside it
        assert entry.backend == choose_backend(entry.ms, entry.error), entry
        assert entry.error[entry.backend] <= MAX_FAST_ERROR
