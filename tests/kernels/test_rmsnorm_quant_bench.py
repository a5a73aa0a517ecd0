"""benchmarks/bench_rmsnorm_quant.py at toy sizes on the CPU: both sides timed per case, the bit-identity check,
the JSON rows and the RESULT line.

The kernels run through the interpreter in float16 (it computes bf16 on raw bits); CUDA-graph timing is
replaced by a wall-clock timer (only the flow is checked here). On the GPU the same script measures rows
1 / 32 / 448 / 8,192 x 4,096 in bf16 (docs/fp8.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.kernels.helpers import ON_GPU

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")


def _wall_ms(fn) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports kernel_bench_utils as a sibling
    import bench_rmsnorm_quant

    monkeypatch.setattr(bench_rmsnorm_quant, "DEVICE", "cpu")
    monkeypatch.setattr(bench_rmsnorm_quant, "DTYPE", torch.float16)
    monkeypatch.setattr(bench_rmsnorm_quant, "time_ms", _wall_ms)
    monkeypatch.setattr(bench_rmsnorm_quant, "HIDDEN", 96)
    monkeypatch.setattr(bench_rmsnorm_quant, "ROWS", [1, 5])
    yield bench_rmsnorm_quant
    sys.modules.pop("bench_rmsnorm_quant", None)


def test_the_bench_times_both_sides_and_checks_identity(bench, tmp_path, monkeypatch, capsys):
    rows_path = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["bench_rmsnorm_quant.py", "--json", str(rows_path)])
    bench.main()
    rows = json.loads(rows_path.read_text())
    assert [(r["rows"], r["hidden"]) for r in rows] == [(1, 96), (5, 96)]
    for row in rows:
        assert row["fp8_differ"] == row["scale_differ"] == row["stream_differ"] == 0, row
        assert row["fused_us"] > 0 and row["unfused_us"] > 0 and row["ratio"] > 0
    out = capsys.readouterr().out
    assert out.count("| identical") == 2
    assert "RESULT fp8-norm-quant:" in out and "5x96" in out
