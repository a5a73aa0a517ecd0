"""benchmarks/bench_fused_mlp.py on the CPU: the fused MLP's arithmetic through Triton's interpreter at toy sizes,
and the script's flow, before a GPU run spends device time on it.

The interpreter runs a grid's programs one after another, so only a launch of one program (which does every unit
and passes its barrier alone) computes the MLP there; a launch of several gives up at the barrier (the flag says
so) and leaves the counter at zero for the next launch."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.bench_scripts import bench_script, wall_ms
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")

TOY_CONFIGS = [(32, 64, 2, 64, 4, 2, 0, 4), (32, 64, 2, 32, 4, 2, 256, 4), (16, 32, 4, 32, 4, 1, 0, 2)]


@pytest.fixture
def bench(monkeypatch):
    yield from bench_script(monkeypatch, "bench_fused_mlp", DEVICE="cpu", DTYPE=torch.float16, HIDDEN=128,
                            INTERMEDIATE=256, CONFIGS=TOY_CONFIGS, SPIN_LIMIT=3, time_ms=wall_ms,
                            table_configs=lambda: (None, None))  # fmt: skip


def _operands(bench):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(bench.HIDDEN, generator=generator).half()
    w_gate_up = (torch.randn(2 * bench.INTERMEDIATE, bench.HIDDEN, generator=generator) * 0.1).half()
    w_down = (torch.randn(bench.HIDDEN, bench.INTERMEDIATE, generator=generator) * 0.1).half()
    bufs = bench.Buffers.new(bench.HIDDEN, bench.INTERMEDIATE, torch.float16, "cpu")
    bufs.out.fill_(123.0)  # every element is written
    return x, w_gate_up, w_down, bufs


def _counters_zero(bufs) -> bool:
    return int(bufs.counter.item()) == 0 and int(bufs.tiles.abs().sum()) == 0


@pytest.mark.parametrize("config", TOY_CONFIGS)
def test_one_program_computes_the_mlp(bench, config):
    x, w_gate_up, w_down, bufs = _operands(bench)
    got = bench.fused_mlp(x, w_gate_up, w_down, bufs, config, programs=1)
    assert int(bufs.flag.item()) == 0 and _counters_zero(bufs)
    torch.testing.assert_close(got.float(), bench.reference(x, w_gate_up, w_down), rtol=2e-3, atol=2e-3)


def test_several_programs_give_up_at_the_barrier_alone_and_reset_the_counters(bench):
    x, w_gate_up, w_down, bufs = _operands(bench)
    bench.fused_mlp(x, w_gate_up, w_down, bufs, TOY_CONFIGS[1], spin_limit=2)
    assert bench.units(TOY_CONFIGS[1]) == (8, 4)
    assert int(bufs.flag.item()) == 1 and _counters_zero(bufs)


def test_more_programs_than_down_units_are_refused(bench):
    x, w_gate_up, w_down, bufs = _operands(bench)
    with pytest.raises(AssertionError, match="one program a down unit"):
        bench.fused_mlp(x, w_gate_up, w_down, bufs, TOY_CONFIGS[0], programs=5)


def test_cpu_toy_run_reports_the_engine_launches_and_skips_what_cannot_be_resident(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_fused_mlp.py"])
    bench.main()
    out = capsys.readouterr().out
    assert "the engine's two launches" in out
    assert out.count("not every program resident") == len(TOY_CONFIGS)
