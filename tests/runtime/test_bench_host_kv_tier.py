"""benchmarks/bench_host_kv_tier.py at a tiny size on CPU: both modes run in one process over the
same workload, the tier's hits show up only with it on, and the JSON carries every figure."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_host_kv_tier

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tier_off_and_on_in_one_run(tmp_path, capsys):
    out = tmp_path / "host_tier.json"
    assert bench_host_kv_tier.main(["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--tenants", "12",
                                    "--prefix-tokens", "64", "--question-tokens", "8", "--output-tokens", "2",
                                    "--concurrency", "2", "--json", str(out)]) == 0
    off, on = json.loads(out.read_text())
    assert (off["mode"], on["mode"]) == ("host tier off", "host tier on")
    assert off["requests"] == on["requests"] == 12
    assert off["host_hit_rate"] == 0 and off["onload_gib"] == 0
    assert on["host_hit_rate"] > 0.5 and on["onload_gib"] > 0 and on["offload_gib"] > 0
    assert "TTFT p50 off/on" in capsys.readouterr().out
