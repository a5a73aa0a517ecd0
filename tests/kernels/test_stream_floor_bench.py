"""benchmarks/bench_stream_floor.py as a CPU toy: toy byte counts through Triton's interpreter, wall-clock timed, so
the script's flow (every config's sums checked, the fit, the layer chain, the report) runs before a GPU run spends
device time on it."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.bench_scripts import bench_script, wall_ms
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")


@pytest.fixture
def bench(monkeypatch):
    yield from bench_script(monkeypatch, "bench_stream_floor", DEVICE="cpu", DTYPE=torch.float16, L2_DEFEAT_BYTES=0,
                            LLAMA3_8B={"qkv": (48, 32), "o": (32, 32), "gate_up": (224, 32), "down": (32, 112)},
                            VOCAB=96, HIDDEN=32, ATTENTION_BYTES=2 * 1000, CONFIGS=[(1, 64, 4), (2, 128, 4)],
                            time_ms=wall_ms)  # fmt: skip


def test_each_program_sums_its_share_exactly_once(bench):
    src = torch.arange(1000, dtype=torch.float16)  # 1000 elements: the last tile of each share is partial
    out = torch.zeros(64, dtype=torch.float32)
    for config in ([1, 64, 4], [2, 128, 4], [4, 16, 1]):
        partial = bench.stream_read(src, out, tuple(config))
        assert partial.numel() == config[0] * 8  # programs per SM x the interpreter's 8 "SMs"
        assert partial.double().sum().item() == float(sum(range(1000)))


def test_cpu_toy_run_prints_every_size_the_fit_and_the_step(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_stream_floor.py"])
    bench.main()
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if " | floor " in line]
    assert [line.split()[0] for line in lines[:6]] == ["qkv", "attention", "o", "gate_up", "down", "lm_head"]
    assert all("cuBLAS / floor" in line for line in lines)
    assert "one layer as five reads in a graph" in out and "32 layers + lm_head" in out


def test_fit_recovers_a_line(bench):
    a, bandwidth = bench.fit([(1_000_000, 5.0 + 1.0), (4_000_000, 5.0 + 4.0), (9_000_000, 5.0 + 9.0)])
    assert a == pytest.approx(5.0) and bandwidth == pytest.approx(1.0)
