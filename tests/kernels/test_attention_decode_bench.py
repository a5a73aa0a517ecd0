"""benchmarks/bench_attention_decode.py --small-batch's case, run through Triton's interpreter at a toy size
(one sequence, a 512-token context, 1 / 2 / 4 splits) with the CUDA-graph timer replaced: only the flow is
checked (every split count timed with both merges, the fused outputs bit-identical, the counters back at
zero, the chosen count told 131,072 tokens: three rows per case; over the bf16 cache each inner loop of the sweep). On the H200 the script runs it at full size (benchmarks/gpu_profile_run.sh attn-small).
"""

from __future__ import annotations

import os

import pytest

from tests.kernels.bench_scripts import bench_script
from tests.kernels.helpers import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU run of the script; on the GPU it runs at full size")


@pytest.fixture
def bench(monkeypatch):
    yield from bench_script(monkeypatch, "bench_attention_decode")


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_small_batch_case_times_both_merges_at_every_split_count(bench, monkeypatch, fp8):
    timed: list[object] = []

    def fake_time_ms(fn):
        fn()
        timed.append(fn)
        return 0.01 * (1 + len(timed) % 3)

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "MIN_ROTATED_FP8_BYTES", 1)
    monkeypatch.setattr(bench, "SMALL_SPLITS", (1, 2, 4))
    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    monkeypatch.delenv("SITS_DECODE_SPLIT_TOKENS", raising=False)
    monkeypatch.delenv("SITS_DECODE_VARIANT", raising=False)
    rows, note = bench.small_batch_case(1, 512, fp8)
    # two-launch at 1, 2, 4 splits; fused at 2, 4 (one split has no merge); the chosen count told 131,072 tokens;
    # both merges at each least split length of the sweep, and over the bf16 cache the fused RoPE as well, and the
    # fused RoPE in each inner loop of the half-cache sweep
    variants = 0 if fp8 else len(bench.HALF_VARIANT_SWEEP)
    assert len(timed) == 6 + (2 if fp8 else 3) * len(bench.MIN_TOKENS_SWEEP) + variants
    case = f"{'fp8' if fp8 else 'bf16'} B1 ctx512"
    assert [row.case for row in rows] == [case, f"{case} fused merge", f"{case} told 131072"]
    extra = rows[1].extra
    assert extra["fused_bit_identical"] is True
    assert set(extra["fused_us_by_splits"]) == set(extra["us_by_splits"]) == {1, 2, 4}
    assert "fused bit-identical: True" in note
    assert rows[2].extra["wide_bound"] == 131_072 and "told 131072 tokens" in note
    assert set(rows[2].extra["min_tokens_us"]) == set(bench.MIN_TOKENS_SWEEP)
    assert all((times[2] is None) == fp8 for times in rows[2].extra["min_tokens_us"].values())
    assert "SITS_DECODE_SPLIT_TOKENS" not in os.environ  # restored after the sweep
    assert list(rows[0].extra["half_variant_us"]) == ([] if fp8 else list(bench.HALF_VARIANT_SWEEP))
    assert ("bf16 inner loops" in note) != fp8
    assert "SITS_DECODE_VARIANT" not in os.environ
