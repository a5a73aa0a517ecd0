"""Compile every shipped config of the fused RMSNorm + small-M GEMM for the H200 (sm_90a) without a GPU.

    python benchmarks/compile_gemm_small_m_norm_sm90.py [--dtype bf16] [--k 4096] [--json out.json]

For each config of sits.kernels.gemm_small_m_norm.NORM_GPU_CONFIGS, both variants (plain: qkv_proj; SiLU·mul:
gate_up_proj) and both stream cases (a float32 residual added; the first layer's stream started from x),
sits.kernels.gemm_small_m_norm's kernel is compiled at its only row tile (BLOCK_M 16: M <= 8) as a
Llama-3-8B launch specializes it (K = 4,096, so the first pass's row block is 4,096), then ptxas reports
registers and spills (see compile_gemm_small_m_sm90.py). Configs the autotuner's prune drops
(`kept_by_prune` false) cannot launch; the others must fit: shared memory as Triton allocates it is printed
beside the prune's bound. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse

import triton
from compile_gemm_small_m_sm90 import short
from sm90_compile import compile_sm90, report_rows

from sits.kernels import gemm_small_m, gemm_small_m_norm
from sits.kernels.launch_utils import next_power_of_2

_ALIGNED = ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "out_ptr", "res_out_ptr", "N", "K", "stride_xm", "stride_rm",
            "stride_rom", "stride_wn", "stride_om")
BLOCK_M = 16


def compile_one(config: triton.Config, silu_mul: bool, has_residual: bool, k: int, dtype: str = "bf16") -> dict:
    """One config and variant compiled for sm_90a: registers, spills, shared memory, wgmma or not."""
    types = {"x_ptr": f"*{dtype}", "res_ptr": "*fp32", "nw_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
             "out_ptr": f"*{dtype}", "res_out_ptr": "*fp32", "eps": "fp32"}
    constexprs = dict(config.kwargs, BLOCK_M=BLOCK_M, SILU_MUL=silu_mul, EVEN_K=k % config.kwargs["BLOCK_K"] == 0,
                      DOT_FP32=False, ROW_BLOCK=next_power_of_2(k), HAS_RESIDUAL=has_residual, WRITE_RESIDUAL=True)
    return compile_sm90(gemm_small_m_norm._small_m_norm_gemm_kernel, types, constexprs, _ALIGNED, config)


def _describe(config: triton.Config, silu_mul: bool, has_residual: bool, k: int, dtype: str) -> dict:
    predicted = gemm_small_m_norm.shared_memory_bytes(config, BLOCK_M, silu_mul)
    return {"config": short(config), "silu_mul": silu_mul, "has_residual": has_residual, "k": k,
            "kept_by_prune": predicted <= gemm_small_m.SMEM_BYTES, "predicted_shared_bytes": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--k", type=int, default=4096, help="the hidden size (K of qkv_proj and gate_up_proj)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    todo = [(config, silu_mul, has_residual, args.k, args.dtype) for config in gemm_small_m_norm.NORM_GPU_CONFIGS
            for silu_mul in (False, True) for has_residual in (True, False)]
    report_rows(todo, _describe, compile_one, args.json)


if __name__ == "__main__":
    main()
