"""The decode split kernel compiles for the H200 (sm_90a) without a GPU, with its fused merge at the largest
merge size (BLOCK_S 64) and without it, for the first bf16 config and the fp8 default schedule, with no
register spills (the full list: benchmarks/compile_attention_decode_sm90.py without --quick).

Runs the script in a process of its own (Triton's interpreter, on for the other kernel tests here, cannot
compile); skipped where Triton bundles no ptxas-blackwell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
pytestmark = pytest.mark.skipif(not os.access(PTXAS, os.X_OK), reason="Triton's bundled ptxas-blackwell is missing")


def test_split_kernel_with_fused_merge_compiles_for_sm90_without_spills(tmp_path):
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_attention_decode_sm90.py"), "--quick",
                           "--merge-blocks", "64", "--json", str(out)], capture_output=True, text=True, timeout=540,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {(row["cache"], row["fused_merge_block"]) for row in rows} == {
        ("bf16", 0), ("bf16", 64), ("fp8", 0), ("fp8", 64)}
    for row in rows:
        assert "error" not in row, row
        assert row["regs"] is not None and row["regs"] <= 255, row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
