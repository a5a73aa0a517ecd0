"""benchmarks/bench_fp8_accum.py at toy sizes on the CPU: every backend measured, the rule applied, and a
table file written that the engine's loader reads back.

The Triton backends run through the interpreter and torch._scaled_mm through PyTorch's CPU kernel;
CUDA-event timing is replaced by a wall-clock timer (the figures are the CPU's, only their flow is
checked here). On the GPU the same script measures the Llama-3-8B shapes (docs/fp8.md).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from sits.kernels.fp8_accum import BACKENDS, MAX_FAST_ERROR, choose_backend, load_accum_table
from sits.kernels.fp8_quantize import quantize_fp8_per_token_reference
from tests.kernels.bench_scripts import bench_script, wall_ms
from tests.kernels.helpers import ON_GPU


@pytest.fixture
def bench(monkeypatch):
    # the interpreter computes bf16 on raw bits: quantize the bf16 activations with the reference
    yield from bench_script(monkeypatch, "bench_fp8_accum", DEVICE="cpu", time_ms=wall_ms,
                            quantize_fp8_per_token=quantize_fp8_per_token_reference,
                            LLAMA3_8B={"qkv": (32, 64), "down": (16, 128)}, M_VALUES=(8, 160))


@pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")
def test_the_bench_measures_every_backend_and_writes_a_table_the_engine_loads(bench, tmp_path, monkeypatch, capsys):
    table_path, rows_path = tmp_path / "fp8_accum_table.json", tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["bench_fp8_accum.py", "--table", str(table_path), "--json", str(rows_path)])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 0
    table = load_accum_table(table_path, device_name="cpu")
    assert sorted(table.entries) == [(8, 16, 128), (8, 32, 64), (256, 16, 128), (256, 32, 64)]
    for entry in table.entries.values():
        assert set(entry.ms) == set(entry.error) == set(BACKENDS)  # all four ran
        assert max(entry.error.values()) < 1e-5 < MAX_FAST_ERROR  # float32 sums on the CPU: rounding only
        assert entry.backend == choose_backend(entry.ms, entry.error)
    out = capsys.readouterr().out
    assert "RESULT fp8-modes: measured table of cpu: " in out and "checks: skipped" in out
    table_line = next(line for line in out.splitlines() if line.startswith("TABLE "))
    assert json.loads(table_line.removeprefix("TABLE ")) == json.loads(table_path.read_text())
    rows = json.loads(rows_path.read_text())["rows"]
    assert [r["extra"]["chosen"] for r in rows] == [table.entries[(b, n, k)].backend
                                                    for b in (8, 256) for n, k in ((32, 64), (16, 128))]
    assert all(torch.isfinite(torch.tensor(r["ratio"])) for r in rows)


@pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")
def test_the_bench_re_measures_some_buckets_into_an_existing_table(bench, tmp_path, monkeypatch, capsys):
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    monkeypatch.setattr(sys, "argv", ["bench_fp8_accum.py", "--table", str(old_path)])
    with pytest.raises(SystemExit):
        bench.main()
    old = load_accum_table(old_path, device_name="cpu")
    monkeypatch.setattr(sys, "argv", ["bench_fp8_accum.py", "--m", "8", "--update", str(old_path),
                                      "--table", str(new_path)])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 0
    new = load_accum_table(new_path, device_name="cpu")
    assert sorted(new.entries) == sorted(old.entries)
    for key, entry in new.entries.items():
        if key[0] == 256:  # not measured this time: kept as it was
            assert entry == old.entries[key]
        else:  # measured again: new timings
            assert entry.ms != old.entries[key].ms
    assert "M8 " in capsys.readouterr().out

    other = tmp_path / "other.json"
    other.write_text(old_path.read_text().replace('"device": "cpu"', '"device": "NVIDIA H200"'))
    for argv, message in ((["--update", str(other)], "measured on 'NVIDIA H200', this is 'cpu'"),
                          (["--update", str(tmp_path / "missing.json")], "No such file"),
                          (["--m", "8,x"], "--m takes comma-separated positive integers")):
        monkeypatch.setattr(sys, "argv", ["bench_fp8_accum.py", *argv])
        with pytest.raises(SystemExit) as exit_info:
            bench.main()
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
