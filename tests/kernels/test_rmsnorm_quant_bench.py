"""benchmarks/bench_rmsnorm_quant.py at toy sizes on the CPU: both sides timed per case, the bit-identity check,
the JSON rows and the RESULT line.

The kernels run through the interpreter in float16 (it computes bf16 on raw bits); CUDA-graph timing is
replaced by a wall-clock timer (only the flow is checked here). On the GPU the same script measures rows
1 / 32 / 448 / 8,192 x 4,096 in bf16 (docs/fp8.md).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.kernels.bench_scripts import bench_script, wall_ms
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")


@pytest.fixture
def bench(monkeypatch):
    yield from bench_script(monkeypatch, "bench_rmsnorm_quant", DEVICE="cpu", DTYPE=torch.float16, time_ms=wall_ms,
                            HIDDEN=96, ROWS=[1, 5])


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
