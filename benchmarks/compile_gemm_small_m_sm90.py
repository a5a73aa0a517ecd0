"""Compile every shipped config of the small-M GEMM for the H200 (sm_90a) without a GPU; print ptxas's report.

    python benchmarks/compile_gemm_small_m_sm90.py [--dtype bf16] [--x-dtype fp32] [--block-m 16,32,64] [--heaviest]
        [--json out.json]

For each config of sits.kernels.gemm_small_m.GPU_CONFIGS, each row tile (BLOCK_M 16, 32, 64: the
binaries a decode batch of 1 to 64 rows uses) and both variants (plain, SiLU·mul), the kernel is
compiled as a Llama-3-8B launch specializes it (pointers 16-byte aligned; N, K and the row strides
multiples of 16; whole K tiles; M and its bucket not specialized), then the bundled ptxas assembles
the PTX for sm_90a and reports registers, spill stores / loads (CompiledKernel.n_regs needs a GPU,
hence ptxas); the shared memory comes from Triton's metadata, and "wgmma" says whether the dot became
Hopper's warpgroup MMA (else mma.sync). With --heaviest, each config only at the launch that needs the
most registers among those the autotuner keeps: the SiLU·mul variant at the widest row tile whose
pipeline fits shared memory (what tests/kernels/test_sm90_compile.py checks). Run it without
TRITON_INTERPRET: the interpreter's kernels cannot be compiled. --x-dtype fp32 compiles the launches of float32
activations beside the weight (--activation-dtype float32: two dots a tile, float32 out), with the shared
memory predicted for them.
"""

from __future__ import annotations

import argparse

import triton
from sm90_compile import compile_sm90, report_rows

from sits.kernels import gemm_small_m

_ALIGNED = ("x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om")


def compile_one(config: triton.Config, block_m: int, silu_mul: bool, dtype: str = "bf16", x_dtype: str = "") -> dict:
    """One config at one row tile, compiled for sm_90a: its registers, spills and shared memory (x_dtype: the
    activations' and output's, when not the weight's)."""
    x_dtype = x_dtype or dtype
    types = {"x_ptr": f"*{x_dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{x_dtype}"}
    constexprs = dict(config.kwargs, BLOCK_M=block_m, SILU_MUL=silu_mul, EVEN_K=True, DOT_FP32=False)
    return compile_sm90(gemm_small_m._small_m_gemm_kernel, types, constexprs, _ALIGNED, config)


def short(config: triton.Config) -> str:
    """A config as BLOCK_N x BLOCK_K, operand order, warps and stages (e.g. n32k256-swap-w4s4)."""
    kw = config.kwargs
    order = "swap" if kw["SWAP_AB"] else "ab"
    return f"n{kw['BLOCK_N']}k{kw['BLOCK_K']}-{order}-w{config.num_warps}s{config.num_stages}"


def _x_bytes(x_dtype: str) -> dict:
    return {"x_bytes": 4} if x_dtype == "fp32" else {}


def launches(config: triton.Config, block_ms: list[int], heaviest: bool, x_dtype: str = "") -> list[tuple[bool, int]]:
    """(silu_mul, block_m) of each launch to compile for `config`: all, or only its heaviest kept one."""
    if not heaviest:
        return [(silu_mul, block_m) for silu_mul in (False, True) for block_m in block_ms]
    fitting = [b for b in block_ms
               if gemm_small_m.shared_memory_bytes(config, b, True, **_x_bytes(x_dtype)) <= gemm_small_m.SMEM_BYTES]
    return [(True, max(fitting or block_ms))]


def _describe(config: triton.Config, silu_mul: bool, block_m: int, dtype: str, x_dtype: str = "") -> dict:
    predicted = gemm_small_m.shared_memory_bytes(config, block_m, silu_mul, **_x_bytes(x_dtype))
    return {"config": short(config), "block_m": block_m, "silu_mul": silu_mul, "dtype": dtype,
            "x_dtype": x_dtype or dtype, "kept_by_prune": predicted <= gemm_small_m.SMEM_BYTES,
            "predicted_shared_bytes": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--x-dtype", default="", choices=("", "fp32"),
                        help="the activations' dtype where not the weight's (fp32: --activation-dtype float32)")
    parser.add_argument("--block-m", default="16,32,64", help="comma-separated row tiles")
    parser.add_argument("--heaviest", action="store_true",
                        help="each config at its heaviest kept launch only (SiLU·mul, widest fitting row tile)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    block_ms = [int(v) for v in args.block_m.split(",")]
    todo = [(config, silu_mul, block_m, args.dtype, args.x_dtype) for config in gemm_small_m.GPU_CONFIGS
            for silu_mul, block_m in launches(config, block_ms, args.heaviest, args.x_dtype)]
    report_rows(todo, _describe, lambda c, silu, bm, dtype, x: compile_one(c, bm, silu, dtype, x), args.json)


if __name__ == "__main__":
    main()
