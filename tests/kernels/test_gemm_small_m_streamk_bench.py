"""benchmarks/bench_gemm_small_m_streamk.py as a CPU toy: toy shapes in fp16 through Triton's interpreter,
wall-clock timed, so the script's flow is checked before a GPU run spends device time on it: every stream-K
config (pointer and TMA loads) runs and matches the float64 product, beside the table's launch and cuBLAS."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.bench_scripts import bench_script, wall_ms
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")

TOY_CONFIGS = [(32, 32, 4, 1, 1, 0), (32, 32, 4, 2, 2, 1), (64, 32, 4, 1, 1, 1)]


@pytest.fixture
def bench(monkeypatch):
    yield from bench_script(monkeypatch, "bench_gemm_small_m_streamk", DEVICE="cpu", DTYPE=torch.float16,
                            PROJ={"qkv": (96, 64), "o": (96, 64), "down": (64, 160)}, CONFIGS=TOY_CONFIGS, L2_DEFEAT_BYTES=0,
                            time_ms=wall_ms)  # fmt: skip


def test_cpu_toy_run_measures_every_config(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_gemm_small_m_streamk.py", "--m", "1,5", "--proj", "o,down"])
    bench.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if " | " in line]
    assert [line.split()[0:2] for line in lines] == [["o", "M1"], ["down", "M1"], ["o", "M5"], ["down", "M5"]]
    assert all("stream-K best" in line and "table / stream-K" in line for line in lines)
    result = bench.bench_case("down", 3, bench.load_small_m_table(device_name="cpu"))
    assert result["failed"] == {}
    assert len(result["streamk"]) == len(TOY_CONFIGS)
    assert all(us > 0 and err < 3e-3 for us, err in result["streamk"].values()), result
    assert result["table_us"] > 0 and result["table_err"] < 3e-3


def test_cpu_toy_run_of_the_folded_forms(bench, monkeypatch, capsys):
    """--fold: qkv scaled by the norm's 1 / rms, o and down feeding the stream, each against the engine's launch."""
    monkeypatch.setattr(
        sys, "argv", ["bench_gemm_small_m_streamk.py", "--m", "3", "--proj", "qkv,o,down", "--fold"]
    )
    bench.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if " | " in line]
    assert [line.split()[0] for line in lines] == ["qkv", "o", "down"]
    assert "direct scaled" in lines[0] and "to_stream" in lines[1] and "to_stream" in lines[2]
    table = bench.load_small_m_table(device_name="cpu")
    for name in ("qkv", "o"):
        result = bench.bench_case(name, 3, table, fold=True)
        assert result["failed"] == {} and len(result["streamk"]) == len(TOY_CONFIGS)
        assert all(err < 1e-2 for _, err in result["streamk"].values()), result  # the output's fp16 rounding
        assert result["table_err"] < 1e-2
