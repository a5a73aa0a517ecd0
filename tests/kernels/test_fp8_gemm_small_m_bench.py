"""benchmarks/bench_fp8_small_m.py at toy sizes on the CPU: the three sides measured per case, the rule's
pick, the per-step sums, and the config check that drops a config that cannot run.

The Triton kernels run through the interpreter and torch._scaled_mm through PyTorch's CPU kernel;
CUDA-graph timing is replaced by a wall-clock timer (only the flow is checked here). On the GPU the
same script measures the Llama-3-8B shapes (docs/fp8.md).
"""

from __future__ import annotations

import json
import sys

import pytest

from sits.kernels import fp8_gemm as fp8_gemm_module
from sits.kernels.fp8_quantize import quantize_fp8_per_token_reference
from tests.kernels.bench_scripts import bench_script, wall_ms
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")


@pytest.fixture
def bench(monkeypatch):
    # the interpreter computes bf16 on raw bits: quantize the bf16 activations with the reference;
    # K <= 2 N (the direct kernel's side of the rule) and K = 6 N (split-K's)
    yield from bench_script(monkeypatch, "bench_fp8_small_m", DEVICE="cpu", time_ms=wall_ms,
                            hbm_copy_gbps=lambda: 1.0, quantize_fp8_per_token=quantize_fp8_per_token_reference,
                            LLAMA3_8B={"wide": (64, 32), "long": (16, 96)})


def test_the_bench_times_three_sides_and_sums_the_rules_pick(bench, tmp_path, monkeypatch, capsys):
    rows_path = tmp_path / "rows.json"
    argv = ["bench_fp8_small_m.py", "--m", "5,17", "--proj", "wide,long", "--no-check", "--json", str(rows_path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rows = json.loads(rows_path.read_text())
    assert [(r["m"], r["proj"]) for r in rows] == [(5, "wide"), (5, "long"), (17, "wide"), (17, "long")]
    for row in rows:
        for side in bench.SIDES:
            assert row[f"{side}_us"] > 0 and row[f"{side}_tbps"] > 0, row
            assert row[f"{side}_err"] < 1e-2, row  # bf16 outputs against float32 sums: rounding only
        assert row["rule_picks"] == ("direct" if row["proj"] == "wide" else "atomic")
    out = capsys.readouterr().out
    for m in (5, 17):
        step_line = next(line for line in out.splitlines() if line.startswith(f"M{m}: one decode step"))
        picked = sum(r[f"{r['rule_picks']}_us"] for r in rows if r["m"] == m) * bench.LAYERS / 1e3
        assert f"fp8_gemm's rule {picked:.3f} ms" in step_line


def test_the_config_check_drops_a_config_that_cannot_run(bench, monkeypatch, capsys):
    good = fp8_gemm_module._direct_config(32, 32, True, 4, 1)
    bad = fp8_gemm_module._direct_config(48, 32, False, 4, 1)  # a column tile that is not a power of two
    monkeypatch.setattr(fp8_gemm_module, "_DIRECT_CONFIGS", [good, bad])
    monkeypatch.setattr(fp8_gemm_module._fp8_gemm_direct, "configs", [good, bad])
    failed = bench.check_configs(5, 40, 80, drop_failing=True)
    assert failed == [bad]
    assert fp8_gemm_module._fp8_gemm_direct.configs == [good]
    out = capsys.readouterr().out
    assert "n32k32-swap-w4s1: max rel err" in out and "n48k32-ab-w4s1: FAILED" in out
    assert "dropped from the direct kernel's autotuning: n48k32-ab-w4s1" in out
