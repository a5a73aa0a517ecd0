"""The fused add + RMSNorm + e4m3 quantization compiles for the H200 (sm_90a) without a GPU: every launch a
served hidden size makes (and a three-pass row), each stream case, without a spilled register.

Runs benchmarks/compile_rmsnorm_quant_sm90.py in a process of its own (Triton's interpreter, on for the other
kernel tests here, cannot compile); skipped where Triton bundles no ptxas-blackwell.
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


def test_every_launch_compiles_for_sm90_without_spills(tmp_path):
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_rmsnorm_quant_sm90.py"),
                           "--json", str(out)], capture_output=True, text=True, timeout=540, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 18 and sum(not row.get("single_pass", True) for row in rows) == 3
    for row in rows:
        assert "error" not in row, row
        assert row["regs"] is not None and row["regs"] <= 128, row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
