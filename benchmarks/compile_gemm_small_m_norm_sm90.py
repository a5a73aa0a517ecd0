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
import json

import triton
from compile_gemm_small_m_sm90 import _ptxas, short
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sits.kernels import gemm_small_m, gemm_small_m_norm
from sits.kernels.launch_utils import next_power_of_2

_INT_ARGS = ("M", "N", "K", "stride_xm", "stride_rm", "stride_rom", "stride_wn", "stride_om", "M_BUCKET")
_ALIGNED = ("x_ptr", "res_ptr", "nw_ptr", "w_ptr", "out_ptr", "res_out_ptr", "N", "K", "stride_xm", "stride_rm",
            "stride_rom", "stride_wn", "stride_om")
BLOCK_M = 16


def compile_one(config: triton.Config, silu_mul: bool, has_residual: bool, k: int, dtype: str = "bf16") -> dict:
    """One config and variant compiled for sm_90a: registers, spills, shared memory, wgmma or not."""
    fn = gemm_small_m_norm._small_m_norm_gemm_kernel
    signature = {"x_ptr": f"*{dtype}", "res_ptr": "*fp32", "nw_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
                 "out_ptr": f"*{dtype}", "res_out_ptr": "*fp32", **dict.fromkeys(_INT_ARGS, "i32"), "eps": "fp32"}
    constexprs = dict(config.kwargs, BLOCK_M=BLOCK_M, SILU_MUL=silu_mul, EVEN_K=k % config.kwargs["BLOCK_K"] == 0,
                      DOT_FP32=False, ROW_BLOCK=next_power_of_2(k), HAS_RESIDUAL=has_residual, WRITE_RESIDUAL=True)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in _ALIGNED}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return {"shared_bytes": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"],
            **_ptxas(compiled.asm["ptx"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--k", type=int, default=4096, help="the hidden size (K of qkv_proj and gate_up_proj)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    rows = []
    for config in gemm_small_m_norm.NORM_GPU_CONFIGS:
        for silu_mul in (False, True):
            for has_residual in (True, False):
                row = {"config": short(config), "silu_mul": silu_mul, "has_residual": has_residual, "k": args.k}
                try:
                    row.update(compile_one(config, silu_mul, has_residual, args.k, args.dtype))
                except Exception as error:  # noqa: BLE001 - report every config
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                predicted = gemm_small_m_norm.shared_memory_bytes(config, BLOCK_M, silu_mul)
                row["kept_by_prune"] = predicted <= gemm_small_m.SMEM_BYTES
                row["predicted_shared_bytes"] = predicted
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
