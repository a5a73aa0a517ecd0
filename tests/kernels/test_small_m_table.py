"""The small-M GEMM's measured table: the winner rule, the file format, what a table applies to."""

from __future__ import annotations

import json

import pytest

from sits.kernels.small_m_table import (
    DEFAULT_TABLE_PATH,
    MIN_SPEEDUP,
    SmallMEntry,
    SmallMTable,
    choose_winner,
    load_small_m_table,
    m_bucket,
    parse_small_m_table,
)


def _table() -> SmallMTable:
    entries = [
        SmallMEntry("linear", 4096, 4096, 1, "direct", {"direct": 9.0, "cublas": 11.0}),
        SmallMEntry("linear", 4096, 4096, 32, "cublas", {"direct": 12.0, "cublas": 11.0}),
        SmallMEntry("silu_mul", 28672, 4096, 1, "direct", {"direct": 50.0, "cublas": 60.0}),
    ]
    return SmallMTable("NVIDIA H200", {(e.op, e.n, e.k, e.m_bucket): e for e in entries})


def test_winner_rule():
    assert choose_winner(10.0, 10.0 * MIN_SPEEDUP) == "direct"
    assert choose_winner(10.0, 10.1) == "cublas"  # within the margin: cuBLAS stays
    assert choose_winner(None, 10.0) == "cublas" and choose_winner(float("nan"), 10.0) == "cublas"
    assert choose_winner(10.0, None) == "direct"
    # with the split-K side: the faster Triton side, if it beats cuBLAS by the margin
    assert choose_winner(10.0, 12.0, 9.0) == "splitk" and choose_winner(9.0, 12.0, 10.0) == "direct"
    assert choose_winner(12.0, 10.1, 10.0) == "cublas" and choose_winner(None, 12.0, 10.0) == "splitk"


def test_pinned_configs_read_back_and_are_checked():
    direct = {"BLOCK_N": 32, "BLOCK_K": 256, "SWAP_AB": 1, "num_warps": 4, "num_stages": 4}
    rows = [{"op": "linear", "n": 64, "k": 64, "m_bucket": 1, "winner": "direct", "config": direct},
            {"op": "linear", "n": 64, "k": 64, "m_bucket": 32, "winner": "splitk", "config": direct | {"SPLIT_K": 2}},
            {"op": "silu_mul", "n": 64, "k": 64, "m_bucket": 1, "winner": "direct", "config": direct},
            {"op": "linear", "n": 64, "k": 64, "m_bucket": 2, "winner": "direct"}]
    table = parse_small_m_table(json.dumps({"version": 1, "device": "", "entries": rows}))
    assert table.pinned_configs("linear", 64, 64) == {1: direct, 32: direct | {"SPLIT_K": 2}}
    assert table.pinned_configs("silu_mul", 64, 64) == {1: direct}
    assert parse_small_m_table(table.to_json()).entries == table.entries
    for config, winner in ((direct | {"SPLIT_K": 2}, "direct"), (direct, "splitk"), (direct | {"BLOCK_N": 0}, "direct"),
                           (direct | {"SWAP_AB": 2}, "direct"), (direct, "cublas"), ([32], "direct")):
        row = {"op": "linear", "n": 64, "k": 64, "m_bucket": 1, "winner": winner, "config": config}
        with pytest.raises(ValueError, match="'config' pins a Triton winner's launch"):
            parse_small_m_table(json.dumps({"version": 1, "device": "", "entries": [row]}))


def test_split_k_entries_read_back_as_triton_buckets():
    rows = [{"op": "linear", "n": 64, "k": 64, "m_bucket": 32, "winner": "splitk", "us": {"splitk": 9.0, "direct": 10.0,
                                                                                          "cublas": 11.0}},
            {"op": "linear", "n": 64, "k": 64, "m_bucket": 1, "winner": "direct"}]
    table = parse_small_m_table(json.dumps({"version": 1, "device": "", "entries": rows}))
    assert table.direct_buckets("linear", 64, 64) == {1, 32} and table.splitk_buckets(64, 64) == {32}
    assert "split-K at 1" in table.describe()
    assert parse_small_m_table(table.to_json()).entries == table.entries


def test_buckets():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]


def test_round_trip_and_lookup(tmp_path):
    table = _table()
    path = tmp_path / "table.json"
    path.write_text(table.to_json())
    loaded = load_small_m_table(path, device_name="NVIDIA H200")
    assert loaded == table
    assert loaded.direct_buckets("linear", 4096, 4096) == {1}
    assert loaded.direct_buckets("silu_mul", 28672, 4096) == {1}
    assert loaded.direct_buckets("linear", 28672, 4096) == frozenset()
    assert "direct at 2 of 3 shapes" in loaded.describe()


def test_another_gpu_or_no_file_gives_cublas_everywhere(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(_table().to_json())
    assert load_small_m_table(path, device_name="NVIDIA A100-SXM4-80GB").entries == {}
    assert load_small_m_table(tmp_path / "missing.json").entries == {}
    anywhere = SmallMTable("", _table().entries)
    path.write_text(anywhere.to_json())
    assert load_small_m_table(path, device_name="cpu").entries == anywhere.entries


def test_the_shipped_table_is_the_h200_measurement_and_each_winner_follows_its_figures():
    """Measured on the H200 (every batch bucket, 1 to 64): each entry's winner is what choose_winner makes of its
    own timings, so a hand edit that contradicts them fails here."""
    table = load_small_m_table(DEFAULT_TABLE_PATH, device_name="NVIDIA H200")
    assert table.device == "NVIDIA H200" and table.entries
    assert {bucket for (_, _, _, bucket) in table.entries} == {1, 2, 4, 8, 16, 32, 64}
    for entry in table.entries.values():  # a norm op's "cublas" is the faster unfused path
        unfused = min(entry.us["cublas"], entry.us.get("norm_direct", float("inf")))
        assert entry.winner == choose_winner(entry.us["direct"], unfused, entry.us.get("splitk")), entry
    assert table.direct_buckets("linear", 4096, 4096) == {1, 2, 4, 8, 16, 32}  # o_proj: cuBLAS at 64 only
    assert table.splitk_buckets(4096, 4096) == {1, 2, 32}  # the direct kernel at 4 to 16
    assert table.splitk_buckets(4096, 14336) == {1, 2, 4, 8, 16, 32}  # down_proj
    # every Triton winner launches the config timed fastest in CUDA graphs, not the autotuner's pick
    assert all(e.config is not None for e in table.entries.values() if e.winner in ("direct", "splitk"))
    assert load_small_m_table(DEFAULT_TABLE_PATH, device_name="NVIDIA A100-SXM4-80GB").entries == {}


@pytest.mark.parametrize(
    "row,message",
    [
        ({"op": "mlp", "n": 8, "k": 8, "m_bucket": 1, "winner": "direct"}, "op must be"),
        ({"op": "linear", "n": 8, "k": 8, "m_bucket": 3, "winner": "direct"}, "power of two"),
        ({"op": "linear", "n": 8, "k": 8, "m_bucket": 128, "winner": "direct"}, "up to 64"),
        ({"op": "linear", "n": 0, "k": 8, "m_bucket": 1, "winner": "direct"}, "positive"),
        ({"op": "linear", "n": 8, "k": 8, "m_bucket": 1, "winner": "triton"}, "winner must be"),
        ({"op": "silu_mul", "n": 7, "k": 8, "m_bucket": 1, "winner": "direct"}, "even row count"),
        ({"op": "linear", "n": 8, "k": 8, "m_bucket": 1, "winner": "direct", "us": {"x": 1}}, "'us' must map"),
        ({"op": "norm_linear", "n": 8, "k": 8, "m_bucket": 16, "winner": "direct"}, "buckets up to 8"),
        ({"op": "norm_silu_mul", "n": 7, "k": 8, "m_bucket": 1, "winner": "direct"}, "even row count"),
        ({"op": "silu_mul", "n": 8, "k": 8, "m_bucket": 1, "winner": "splitk"}, "only op linear"),
    ],
)
def test_bad_entries_are_named(row, message):
    with pytest.raises(ValueError, match=message):
        parse_small_m_table(json.dumps({"version": 1, "device": "", "entries": [row]}))


def test_bad_files():
    with pytest.raises(ValueError, match="not a small-M GEMM table"):
        parse_small_m_table("[]")
    with pytest.raises(ValueError, match="version 2"):
        parse_small_m_table(json.dumps({"version": 2, "entries": []}))


def test_norm_ops_read_back_beside_the_plain_ones():
    """The fused norm's ops ("direct": the one launch; "cublas": the unfused path, with both unfused sides'
    µs) join a version-1 table; a table with only the plain ops reads as before."""
    table = SmallMTable("NVIDIA H200", {
        ("linear", 6144, 4096, 1): SmallMEntry("linear", 6144, 4096, 1, "direct", {"direct": 20.0, "cublas": 22.0}),
        ("norm_linear", 6144, 4096, 1): SmallMEntry("norm_linear", 6144, 4096, 1, "direct",
                                                    {"direct": 21.0, "cublas": 25.0, "norm_direct": 23.0}),
        ("norm_silu_mul", 28672, 4096, 8): SmallMEntry("norm_silu_mul", 28672, 4096, 8, "cublas",
                                                       {"direct": 90.0, "cublas": 95.0, "norm_direct": 89.0}),
    })  # fmt: skip
    loaded = parse_small_m_table(table.to_json())
    assert loaded == table and json.loads(table.to_json())["version"] == 1
    assert loaded.direct_buckets("norm_linear", 6144, 4096) == {1}
    assert loaded.direct_buckets("norm_silu_mul", 28672, 4096) == frozenset()
    plain = {"version": 1, "device": "", "entries": [{"op": "linear", "n": 8, "k": 8, "m_bucket": 2, "winner":
                                                      "direct", "us": {"direct": 1.0, "cublas": 2.0}}]}  # fmt: skip
    assert parse_small_m_table(json.dumps(plain)).direct_buckets("linear", 8, 8) == {2}
