"""The fused norm + small-M GEMM compiles for the H200 (sm_90a) without a GPU: every shipped config, plain and
SiLU·mul, with a residual stream and without (the first layer), at Llama-3-8B's K; the launches the autotuner
keeps spill no register, and the shared memory Triton allocates is within the prune's bound.

Runs benchmarks/compile_gemm_small_m_norm_sm90.py in a process of its own (Triton's interpreter, on for the
other kernel tests here, cannot compile); skipped where Triton bundles no ptxas-blackwell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from sits.kernels import gemm_small_m, gemm_small_m_norm

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
pytestmark = pytest.mark.skipif(not os.access(PTXAS, os.X_OK), reason="Triton's bundled ptxas-blackwell is missing")


def test_every_config_compiles_for_sm90(tmp_path):
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_gemm_small_m_norm_sm90.py"),
                           "--json", str(out)], capture_output=True, text=True, timeout=540, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 4 * len(gemm_small_m_norm.NORM_GPU_CONFIGS)
    for row in rows:
        assert "error" not in row, row
        assert row["regs"] is not None and row["regs"] <= 255, row
        assert row["shared_bytes"] <= row["predicted_shared_bytes"], row
        if row["kept_by_prune"]:
            assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
            assert row["shared_bytes"] <= gemm_small_m.SMEM_BYTES, row
    assert sum(row["kept_by_prune"] for row in rows) >= 3 * len(gemm_small_m_norm.NORM_GPU_CONFIGS)
