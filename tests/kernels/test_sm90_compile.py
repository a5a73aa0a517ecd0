"""Kernels compile for the H200 (sm_90a) without a GPU, with no register spills where they can launch.

Each test runs a benchmarks/compile_*_sm90.py script in a process of its own (Triton's interpreter, on for
the other kernel tests here, cannot compile) and reads its JSON rows; skipped where Triton bundles no
ptxas-blackwell.

* The small-M GEMM: every shipped config at the heaviest launch the autotuner keeps for it (the SiLU·mul
  variant at the widest row tile whose pipeline fits), and the shared memory Triton allocates is within
  what the autotuner's prune assumes (so every config it keeps fits).
* The small-M GEMM with the decoder norm fused: every config, plain and SiLU·mul, with and without a
  residual; the launches the prune keeps spill nothing and fit.
* The fused add + RMSNorm + e4m3 quantization: every launch a served hidden size makes (and a three-pass
  row), each stream case.
* The fp8 weight-only GEMM (quick list), both decodings: native e4m3 for sm_90a, integer decoding for sm_80.
* The kernels that take USE_PDL (programmatic dependent launch): the wait (and the early trigger) only when asked.
* The L2 row prefetch: an evict-last policy only when asked.
* The fused decode MLP (one cooperative launch) at the bench's configs: no spills, every grid resident at once on
  the H200, and the bulk L2 prefetch in the PTX only where the config asks for it.
* The decode split kernel with its fused merge at the largest merge size (BLOCK_S 64) and without it, for
  the first and the last bf16 config (the most shared memory) and the fp8 default schedule (the full list: the
  script without --quick), each with q rotated before, with the RoPE + KV write fused in, and with a float32 q
  and output (fused RoPE); all within the multiprocessor's shared memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from sits.kernels import gemm_small_m, gemm_small_m_norm, pdl
from sits.kernels.decode_schedules import BF16_CONFIGS, schedule_of

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
pytestmark = pytest.mark.skipif(not os.access(PTXAS, os.X_OK), reason="Triton's bundled ptxas-blackwell is missing")


def compile_rows(tmp_path: Path, script: str, *args: str) -> list[dict]:
    """The rows `benchmarks/<script> *args --json` writes, run without the interpreter."""
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), env.get("PYTHONPATH")]))  # sibling imports
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--json", str(out)], capture_output=True,
                          text=True, timeout=540, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    for row in rows:
        assert "error" not in row, row
        assert row["regs"] is not None and row["regs"] <= 255, row
    return rows


def test_small_m_gemm_configs_compile_without_spills(tmp_path):
    rows = compile_rows(tmp_path, "compile_gemm_small_m_sm90.py", "--heaviest")
    assert len(rows) == len(gemm_small_m.GPU_CONFIGS)
    for row in rows:
        assert row["silu_mul"] and row["kept_by_prune"], row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        # what the prune assumed bounds what Triton allocates (equal, with Triton 3.9): kept configs fit
        assert row["shared_bytes"] <= min(row["predicted_shared_bytes"], gemm_small_m.SMEM_BYTES), row


def test_fused_norm_gemm_configs_compile_and_the_kept_ones_fit(tmp_path):
    rows = compile_rows(tmp_path, "compile_gemm_small_m_norm_sm90.py")
    assert len(rows) == 4 * len(gemm_small_m_norm.NORM_GPU_CONFIGS)
    for row in rows:
        assert row["shared_bytes"] <= row["predicted_shared_bytes"], row
        if row["kept_by_prune"]:
            assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
            assert row["shared_bytes"] <= gemm_small_m.SMEM_BYTES, row
    assert sum(row["kept_by_prune"] for row in rows) >= 3 * len(gemm_small_m_norm.NORM_GPU_CONFIGS)


def test_split_kernel_with_fused_merge_compiles_without_spills(tmp_path):
    rows = compile_rows(tmp_path, "compile_attention_decode_sm90.py", "--quick", "--merge-blocks", "64")
    assert {(row["cache"], row["fused_merge_block"], row["query"]) for row in rows} == {
        (cache, block, query) for cache in ("bf16", "fp8") for block in (0, 64) for query in ("plain", "rope", "f32-rope")}
    for row in rows:
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
    assert {row["schedule"] for row in rows if row["cache"] == "bf16"} == {
        "/".join(map(str, schedule_of(config))) for config in (BF16_CONFIGS[0], BF16_CONFIGS[-1])}
    assert all(row["shared_bytes"] <= gemm_small_m.SMEM_BYTES for row in rows)


def test_rmsnorm_quant_launches_compile_without_spills(tmp_path):
    rows = compile_rows(tmp_path, "compile_rmsnorm_quant_sm90.py")
    assert len(rows) == 18 and sum(not row["single_pass"] for row in rows) == 3
    for row in rows:
        assert row["regs"] <= 128, row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row


def test_fp8_weight_only_gemm_compiles_for_the_h200_and_the_a100(tmp_path):
    """Both decodings, plain and swapped split-K tiles and the prefill tile, whole and ragged K. Before the fix,
    every launch failed to compile: a `return` inside a constexpr `if` of the tile loader fell through."""
    rows = compile_rows(tmp_path, "compile_fp8_weight_only_sm90.py", "--quick")
    assert {(row["decode"], row["sm"]) for row in rows} == {("native", 90), ("bits", 80)}
    assert {row["even_k"] for row in rows} == {True, False}
    assert len(rows) == 12
    for row in rows:
        if row["even_k"]:  # every Llama-shaped launch: whole K tiles
            assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
    assert any(row["wgmma"] for row in rows if row["sm"] == 90)


def test_pdl_kernels_hold_the_wait_and_the_trigger_only_when_asked(tmp_path):
    """Every kernel that takes USE_PDL: no grid-dependency instruction without it, the wait alone when the next
    grid launches at exit, the wait and the trigger when it launches early, and the same registers every way
    (sits.kernels.pdl)."""
    rows = compile_rows(tmp_path, "compile_pdl_sm90.py")
    kernels = {row["kernel"] for row in rows}
    assert len(kernels) == 14 and len(rows) == 42
    by_launch = {(row["kernel"], row["use_pdl"]): row for row in rows}
    for kernel in kernels:
        off, at_exit, early = (by_launch[(kernel, mode)] for mode in (pdl.PDL_OFF, pdl.PDL_AT_EXIT, pdl.PDL_EARLY))
        assert (off["griddepcontrol"], at_exit["griddepcontrol"], early["griddepcontrol"]) == (0, 1, 2), kernel
        assert off["regs"] == at_exit["regs"] == early["regs"], kernel
        assert off["spill_stores"] == at_exit["spill_stores"] == early["spill_stores"] == 0, kernel


def test_prefetches_mark_their_lines_evict_last_only_when_asked(tmp_path):
    """sits.kernels.l2_prefetch's row kernel: an L2 evict-last policy on the bulk prefetches with evict_last, none
    without it (its own PTX: any Triton), no spill."""
    rows = compile_rows(tmp_path, "compile_l2_prefetch_sm90.py")
    assert {(row["kernel"], row["evict_last_asked"]) for row in rows} == {
        (kernel, asked) for kernel in ("rows",) for asked in (False, True)}
    for row in rows:
        assert (row["evict_last"] > 0) == row["evict_last_asked"], row
        assert row["spill_stores"] == 0, row


def test_fused_mlp_configs_compile_without_spills_and_fit_at_once(tmp_path):
    rows = compile_rows(tmp_path, "compile_fused_mlp_sm90.py")
    assert len(rows) == 5
    for row in rows:
        assert row["spill_stores"] == 0 and row["wgmma"] and row["fits_at_once"], row
        assert (row["bulk_prefetches"] > 0) == bool(row["config"].get("PREFETCH")), row
