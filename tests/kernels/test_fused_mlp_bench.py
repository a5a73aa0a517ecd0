"""benchmarks/bench_fused_mlp.py on the CPU: the script's flow at toy sizes through Triton's interpreter (where the
fused launch is one program that runs every unit), before a GPU run spends device time on it."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.kernels.bench_scripts import bench_script, wall_ms
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")

TOY = {"BLOCK_I": 32, "BLOCK_N": 32, "K_SPLIT": 2, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
TOY_CONFIGS = [TOY, {**TOY, "PREFETCH": 64}, {**TOY, "K_SPLIT": 4}]


@pytest.fixture
def bench(monkeypatch):
    yield from bench_script(monkeypatch, "bench_fused_mlp", DEVICE="cpu", DTYPE=torch.float16, HIDDEN=128,
                            INTERMEDIATE=256, CONFIGS=TOY_CONFIGS, time_ms=wall_ms)  # fmt: skip


@pytest.fixture
def toy_table(bench, monkeypatch):
    """The engine's launches at the toy shapes (the committed table holds Llama's): split-K down_proj at TOY's tiles."""
    common = {"BLOCK_K": 32, "SWAP_AB": 1, "num_warps": 4, "num_stages": 1}
    launches = bench.EngineLaunches({"BLOCK_N": 32, **common}, {"BLOCK_N": 32, "SPLIT_K": 2, **common}, True,
                                    torch.zeros(bench.counters_needed(bench.HIDDEN), dtype=torch.int32))
    monkeypatch.setattr(bench, "engine_launches", lambda: launches)
    return launches


def test_the_engine_launches_and_the_fused_one_match_the_reference_and_restore_the_stream(bench, toy_table):
    ops = bench.Operands.new()
    work = bench.FusedMlpWork.new(bench.HIDDEN, bench.INTERMEDIATE, torch.float16, "cpu")
    before = ops.stream.clone()
    assert bench.relative_error(ops, toy_table) < 2e-3
    assert bench.relative_error(ops, lambda o, i: bench.fused(o, i, work, TOY)) < 2e-3
    assert torch.equal(ops.stream, before) and not work.gave_up()
    # At the same tiles the fused launch is the two launches, bit for bit (tests/kernels/test_fused_mlp.py).
    two = toy_table(ops, 1)
    stream_after_two = ops.stream.clone()
    ops.stream.copy_(before)
    assert torch.equal(bench.fused(ops, 1, work, TOY), two) and torch.equal(ops.stream, stream_after_two)


def test_the_table_configs_are_the_engines_at_batch_1(bench, monkeypatch):
    monkeypatch.setattr(bench, "HIDDEN", 4096)
    monkeypatch.setattr(bench, "INTERMEDIATE", 14336)
    launches = bench.engine_launches()
    assert launches.silu_config is not None and launches.down_config is not None
    assert launches.counters.numel() == bench.counters_needed(4096) and launches.splitk == ("SPLIT_K" in launches.down_config)


def test_cpu_toy_run_times_every_config_beside_the_engine_launches(bench, toy_table, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["bench_fused_mlp.py", "--json", str(tmp_path / "rows.json")])
    bench.main()
    assert "split-K down: True" in capsys.readouterr().out
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [row["extra"]["config"] for row in rows] == TOY_CONFIGS
    assert all(row["peer_name"] == "two launches" and row["ours"] > 0 and row["peer"] > 0 for row in rows)
