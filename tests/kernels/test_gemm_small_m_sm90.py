"""The small-M GEMM compiles for the H200 (sm_90a) without a GPU: every shipped config at the heaviest launch
the autotuner keeps for it (the SiLU·mul variant, at the widest row tile whose pipeline fits), with no register
spills, and the shared memory Triton allocates is within what the autotuner's prune assumes (so every config it
keeps fits).

Runs benchmarks/compile_gemm_small_m_sm90.py --heaviest in a process of its own (Triton's interpreter, on
for the other kernel tests here, cannot compile); skipped where Triton bundles no ptxas-blackwell.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from sits.kernels import gemm_small_m

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
pytestmark = pytest.mark.skipif(not os.access(PTXAS, os.X_OK), reason="Triton's bundled ptxas-blackwell is missing")


def test_every_config_compiles_for_sm90_without_spills(tmp_path):
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compile_gemm_small_m_sm90.py"), "--heaviest",
                           "--json", str(out)], capture_output=True, text=True, timeout=540, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert len(rows) == len(gemm_small_m.GPU_CONFIGS)
    for row in rows:
        assert "error" not in row, row
        assert row["silu_mul"] and row["kept_by_prune"], row
        assert row["regs"] is not None and row["regs"] <= 255, row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        # what the prune assumed bounds what Triton allocates (equal, with Triton 3.9): kept configs fit
        assert row["shared_bytes"] <= min(row["predicted_shared_bytes"], gemm_small_m.SMEM_BYTES), row
