"""The fp8 GEMM's backend table (sits.kernels.fp8_accum): the choice rule, the lookup by M bucket, and
the JSON file in both versions, written to disk and loaded as the engine loads it.

The figures are made up where a rule's edge needs them; the table's shape follows what
benchmarks/bench_fp8_accum.py writes on the GPU (whose dispatch tests are in test_fp8_accum_dispatch.py).
"""

from __future__ import annotations

import json
import math

import pytest

from sits.kernels.fp8_accum import (
    BACKENDS,
    DEFAULT_BACKEND,
    MAX_FAST_ERROR,
    MIN_SPEEDUP,
    SCALED_MM_BACKENDS,
    TABLE_VERSION,
    AccumEntry,
    AccumTable,
    backend_at,
    choose_backend,
    load_accum_table,
    m_bucket,
    parse_accum_table,
)

PRECISE_ERROR = 2e-7  # float32 promotion every 128 of K: float32 rounding
FAST_ERROR = 4e-4  # reduced-precision sums over K = 4,096: within the bound


def _errors(**overrides: float) -> dict[str, float]:
    return {"triton": PRECISE_ERROR, "scaled_mm": PRECISE_ERROR, "triton_fast": FAST_ERROR,
            "scaled_mm_fast": FAST_ERROR} | overrides


def test_the_fastest_backend_within_the_error_bound_wins():
    ms = {"triton": 1.0, "scaled_mm": 0.80, "triton_fast": 0.90, "scaled_mm_fast": 0.70}
    assert choose_backend(ms, _errors()) == "scaled_mm_fast"
    assert choose_backend(ms, _errors(scaled_mm_fast=5e-3)) == "scaled_mm"  # fast sums too inexact: next fastest
    assert choose_backend(ms, _errors(scaled_mm_fast=5e-3, scaled_mm=5e-3)) == "triton_fast"
    assert choose_backend({"triton": 1.0, "triton_fast": 0.5}, _errors(triton_fast=MAX_FAST_ERROR)) == "triton_fast"
    assert choose_backend({"triton": 1.0, "triton_fast": 0.5}, _errors(triton_fast=MAX_FAST_ERROR * 1.01)) == "triton"


def test_near_ties_keep_the_more_exact_then_the_triton_backend():
    within = 1 / MIN_SPEEDUP + 0.001  # a hair less than MIN_SPEEDUP faster
    assert choose_backend({"triton": 1.0, "scaled_mm": within}, _errors()) == "triton"
    assert choose_backend({"triton": 1.0, "scaled_mm": 0.9}, _errors()) == "scaled_mm"
    # fast sums only where they beat every precise backend by MIN_SPEEDUP
    assert choose_backend({"triton": 1.0, "scaled_mm": 0.8, "scaled_mm_fast": 0.8 * within}, _errors()) == "scaled_mm"
    assert choose_backend({"triton": 1.0, "triton_fast": 0.7, "scaled_mm_fast": 0.7}, _errors()) == "triton_fast"
    assert choose_backend(dict.fromkeys(BACKENDS, 1.0), _errors()) == "triton"  # exact ties: BACKENDS order


def test_unmeasured_or_broken_figures_are_never_chosen():
    assert choose_backend({}, {}) == DEFAULT_BACKEND
    assert choose_backend({"triton": 1.0, "scaled_mm": None}, _errors()) == "triton"  # torch._scaled_mm refused
    assert choose_backend({"triton": 1.0, "scaled_mm": 0.5}, {"triton": PRECISE_ERROR}) == "triton"  # no error figure
    assert choose_backend({"triton": 1.0, "scaled_mm": math.nan}, _errors()) == "triton"
    assert choose_backend({"triton": 1.0, "scaled_mm": 0.5}, _errors(scaled_mm=math.nan)) == "triton"
    assert choose_backend({"scaled_mm": 0.5, "triton_fast": 0.4}, _errors(triton_fast=1.0)) == "scaled_mm"


def _entry(bucket: int, n: int, k: int, ms: dict[str, float], errors: dict[str, float] | None = None) -> AccumEntry:
    return AccumEntry.measured(bucket, n, k, ms, errors or _errors())


def _llama_table() -> AccumTable:
    """gate_up [28672, 4096]: Triton at decode, torch._scaled_mm from 512 rows, fast sums from 8,192; o: one entry."""
    gate_up = [
        _entry(32, 28672, 4096, {"triton": 0.10, "scaled_mm": 0.12, "triton_fast": 0.10, "scaled_mm_fast": 0.12}),
        _entry(512, 28672, 4096, {"triton": 0.50, "scaled_mm": 0.42, "triton_fast": 0.48, "scaled_mm_fast": 0.41}),
        _entry(8192, 28672, 4096, {"triton": 5.0, "scaled_mm": 4.4, "triton_fast": 4.6, "scaled_mm_fast": 3.9}),
    ]
    o = _entry(4096, 4096, 4096, {"triton": 0.4, "scaled_mm": 0.3})
    return AccumTable("NVIDIA H200", {(e.m_bucket, e.n, e.k): e for e in [*gate_up, o]})


def test_an_m_between_buckets_takes_the_largest_measured_bucket_below():
    table = _llama_table()
    assert table.steps(28672, 4096) == ((32, "triton"), (512, "scaled_mm"), (8192, "scaled_mm_fast"))
    # M rounds up to its bucket first (448 -> 512, 4097 -> 8192), as the Triton kernel's autotune key does
    expected = {1: "triton", 32: "triton", 33: "triton", 256: "triton", 257: "scaled_mm", 448: "scaled_mm",
                512: "scaled_mm", 4096: "scaled_mm", 4097: "scaled_mm_fast", 16384: "scaled_mm_fast",
                1 << 20: "scaled_mm_fast"}
    assert {m: table.backend(m, 28672, 4096) for m in expected} == expected
    assert table.backend(1, 4096, 4096) == table.backend(100000, 4096, 4096) == "scaled_mm"  # one step: everywhere
    assert table.backend(512, 6144, 4096) == "triton"  # (N, K) not measured: the default rule
    assert AccumTable().backend(512, 28672, 4096) == backend_at((), 512) == "triton"
    assert m_bucket(448) == 512 and m_bucket(0) == 1 and m_bucket(1 << 20) == 1 << 16


def test_a_table_round_trips_through_its_file_and_applies_to_its_own_gpu_only(tmp_path):
    table = _llama_table()
    path = tmp_path / "fp8_accum_table.json"
    path.write_text(table.to_json())
    assert json.loads(path.read_text())["version"] == TABLE_VERSION
    assert load_accum_table(path) == table
    assert load_accum_table(path, device_name="NVIDIA H200") == table
    assert load_accum_table(path, device_name="NVIDIA H100 80GB HBM3") == AccumTable()
    assert load_accum_table(tmp_path / "absent.json") == AccumTable()
    assert table.describe() == "measured table of NVIDIA H200: triton 1, scaled_mm 2, scaled_mm_fast 1 of 4 shapes"
    assert AccumTable().describe() == "triton everywhere (default rule)"


def test_a_version_1_table_still_loads_with_its_recorded_choice(tmp_path):
    rows = [{"m_bucket": 8192, "n": 28672, "k": 4096, "fast_accum": True, "precise_error": 2e-7,
             "fast_error": 3.4e-4, "precise_ms": 1.91, "fast_ms": 1.62, "scaled_mm_ms": 1.70},
            {"m_bucket": 32, "n": 28672, "k": 4096, "fast_accum": False, "precise_error": 2e-7,
             "fast_error": 3e-4, "precise_ms": 0.1, "fast_ms": 0.1, "scaled_mm_ms": None}]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "entries": rows}))
    table = load_accum_table(path, device_name="NVIDIA H200")
    fast = table.entries[(8192, 28672, 4096)]
    assert fast.backend == "triton_fast"
    assert fast.ms == {"triton": 1.91, "triton_fast": 1.62, "scaled_mm": 1.70}
    assert fast.error == {"triton": 2e-7, "triton_fast": 3.4e-4}  # torch._scaled_mm timed, its error not measured
    assert table.steps(28672, 4096) == ((32, "triton"), (8192, "triton_fast"))
    assert load_accum_table(path).without(SCALED_MM_BACKENDS) == table  # nothing chose torch._scaled_mm
    assert parse_accum_table(table.to_json()) == table  # written back as version 2


@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "not an fp8 GEMM table"),
    ("{", "not an fp8 GEMM table"),
    (json.dumps({"version": 3, "entries": []}), "version 3: this build reads versions 1 and 2"),
    (json.dumps({"version": 2, "entries": {}}), "'entries' must be a list"),
    (json.dumps({"version": 2, "entries": [7]}), "not an object"),
    (json.dumps({"version": 2, "entries": [{"m_bucket": 100, "n": 1, "k": 1, "backend": "triton"}]}),
     "m_bucket must be a power of two"),
    (json.dumps({"version": 2, "entries": [{"m_bucket": 64, "n": 0, "k": 1, "backend": "triton"}]}),
     "n and k positive"),
    (json.dumps({"version": 2, "entries": [{"m_bucket": 64, "n": 8, "k": 16, "backend": "cublas"}]}),
     "backend must be one of triton, scaled_mm, triton_fast, scaled_mm_fast"),
    (json.dumps({"version": 2, "entries": [{"m_bucket": 64, "n": 8, "k": 16, "backend": "triton",
                                             "ms": {"cutlass": 1.0}}]}), "'ms' must map backends"),
    (json.dumps({"version": 2, "entries": [{"m_bucket": 64, "n": 8, "k": 16, "backend": "triton",
                                             "error": {"triton": "small"}}]}), "'error' must map backends"),
    (json.dumps({"entries": [{"m_bucket": 64, "n": 8, "k": 16, "fast_accum": True}]}), "version 1 rows need"),
])
def test_a_malformed_table_is_refused_with_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_accum_table(path)


def test_without_rechooses_among_the_backends_that_can_run():
    table = _llama_table()
    triton_only = table.without(SCALED_MM_BACKENDS)
    assert triton_only.steps(28672, 4096) == ((32, "triton"), (512, "triton"), (8192, "triton_fast"))
    assert triton_only.backend(4096, 4096, 4096) == "triton"
    assert triton_only.entries[(8192, 28672, 4096)].ms == table.entries[(8192, 28672, 4096)].ms  # figures kept
    assert table.backends_used() == {"triton", "scaled_mm", "scaled_mm_fast"}
    assert triton_only.backends_used() == {"triton", "triton_fast"}
