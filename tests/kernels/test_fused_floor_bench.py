"""benchmarks/bench_fused_floor.py on the CPU: the fused launch's arithmetic and barrier bookkeeping through Triton's
interpreter, and the script's flow as a toy, before a GPU run spends device time on it.

The interpreter runs a grid's programs one after another, so a program waiting at a grid barrier never sees the
others arrive: a launch of several programs gives up at each barrier after its polls (the flag says so) and still
sums every element once; one program alone passes every barrier."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.kernels.bench_scripts import bench_script, wall_ms
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")

TOY_SIZES = {"qkv": 2 * 300, "attention": 2 * 77, "o": 2 * 256, "gate_up": 2 * 1000, "down": 2 * 513,
             "lm_head": 2 * 700}


@pytest.fixture
def bench(monkeypatch):
    yield from bench_script(monkeypatch, "bench_fused_floor", DEVICE="cpu", DTYPE=torch.float16, BLOCK=64,
                            CHAIN_CONFIG=(1, 64, 4), CONFIGS=[(1, 4, 0), (1, 4, 2, 4)], SPIN_LIMIT=3,
                            sizes=lambda: dict(TOY_SIZES), time_ms=wall_ms)  # fmt: skip


def _layer() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(-8, 8, (TOY_SIZES[n] // 2,), generator=generator).to(torch.float16)
            for n in ("qkv", "attention", "o", "gate_up", "down")]


def _buffers():
    return torch.zeros(64, dtype=torch.float32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)


@pytest.mark.parametrize(("preload", "narrow"), [(0, 0), (1, 0), (2, 0), (9, 0), (2, 1), (2, 3)])
def test_one_program_passes_every_barrier_and_reads_each_element_once(bench, preload, narrow):
    layer = _layer()
    out, counter, flag = _buffers()
    args = [x for src in layer for x in (src, src.numel())]
    bench._fused_kernel[(1,)](*args, out, counter, flag, 5, PRELOAD=preload, BLOCK=64, NARROW=narrow)
    assert int(flag.item()) == 0 and int(counter.item()) == 0
    assert out[0].item() == sum(float(src.double().sum()) for src in layer)


@pytest.mark.parametrize("config", [(1, 4, 1), (1, 4, 1, 2)])  # the second: attention's K / V read by 2 of 8
def test_programs_that_cannot_all_be_resident_give_up_and_still_sum_everything(bench, config):
    layer = _layer()
    out, counter, flag = _buffers()
    partial = bench.fused_read(layer, out, counter, flag, config, spin_limit=2)
    assert partial.numel() == 8  # one program per "SM" of the interpreter's 8
    assert int(flag.item()) == 1  # each program waited alone
    assert int(counter.item()) == 0  # the last arrival reset it for the next launch
    assert partial.double().sum().item() == sum(float(src.double().sum()) for src in layer)
    assert not bench.check_fused(layer, out, counter, flag, config)


def test_cpu_toy_run_reports_the_chain_the_one_buffer_read_and_the_skipped_configs(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_fused_floor.py"])
    bench.main()
    out = capsys.readouterr().out
    assert "chain " in out and "one buffer" in out
    assert out.count("not every program resident") == 2
    assert "a step of 32 layers + lm_head" in out
