"""benchmarks/bench_attention_decode_l2.py and bench_attention_decode_bound.py, run through Triton's interpreter at a
toy size with the CUDA-graph timer replaced: only the flow is checked (what each case times, in which order, and the
rows it reports). On the H200 gpu_profile_run.sh runs them at full size (steps attn-l2, attn-bound)."""

from __future__ import annotations

import pytest

from tests.kernels.bench_scripts import bench_script
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the scripts; on the GPU they run at full size")


@pytest.fixture
def shared(monkeypatch):
    """bench_attention_decode (whose cache and RoPE builders both scripts use) on the CPU, at a toy size."""
    yield from bench_script(monkeypatch, "bench_attention_decode", DEVICE="cpu", MIN_ROTATED_FP8_BYTES=1)


def _fake_timer(timed: list):
    def time_ms(fn):
        fn()  # the launch runs once, as time_ms's warm-up call does
        timed.append(fn)
        return 0.01 * len(timed)

    return time_ms


def test_l2_bench_times_each_schedule_cold_then_hot(shared, monkeypatch):
    for bench in bench_script(monkeypatch, "bench_attention_decode_l2", CONTEXT=256):
        timed: list = []
        monkeypatch.setattr(bench, "time_ms", _fake_timer(timed))
        rows = bench.l2_case(1)
        schedules = bench._schedules()
        assert schedules[0] is None and len(schedules) == len(set(schedules)) > 1
        assert len(timed) == 2 * len(schedules)  # cold, then hot, at each
        assert [row.case.split(" ", 2)[2] for row in rows] == [
            "autotuned hot" if s is None else f"{'/'.join(map(str, s))} hot" for s in schedules]
        assert all(row.peer_name == "cold (rotated)" and row.peer < row.ours for row in rows)  # cold timed first


def test_bound_bench_times_the_tight_launch_then_the_bound_four_ways(shared, monkeypatch):
    from sits.kernels import attention_decode, decode_splits
    from sits.kernels.decode_splits import SPLIT_TOKENS_ENV

    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 132)  # an H200's count, so the launches split
    monkeypatch.setattr(decode_splits, "GRAPH_BOUND_BASE", 1024)  # graph bounds 1,024 and 4,096
    monkeypatch.delenv(SPLIT_TOKENS_ENV, raising=False)
    for bench in bench_script(monkeypatch, "bench_attention_decode_bound", CONTEXT=512,
                              num_sms=lambda device: 132):
        timed: list = []
        monkeypatch.setattr(bench, "time_ms", _fake_timer(timed))
        rows = bench.bound_case(1, 4096)
        assert len(timed) == 5
        assert [row.case for row in rows] == ["B1 bound", "B1 bound, tight's tiles", "B1 bound, fused merge",
                                              "B1 graph bound 1024"]
        assert rows[0].extra["splits"] == 16 and rows[3].extra["splits"] == 4  # the graph bound splits as 1,024 does
        tight = rows[0].peer
        assert all(row.peer == tight and row.peer_name.startswith("tight (") for row in rows)
        assert rows[0].extra["splits"] > int(rows[0].peer_name.split("(")[1].split()[0])  # the bound splits more
        assert rows[1].extra["schedule"] == rows[2].extra["schedule"]  # both pinned to the tight launch's tiles
