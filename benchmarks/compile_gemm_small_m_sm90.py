"""Compile every shipped config of the small-M GEMM for the H200 (sm_90a) without a GPU; print ptxas's report.

    python benchmarks/compile_gemm_small_m_sm90.py [--dtype bf16] [--block-m 16,32,64] [--heaviest] [--json out.json]

For each config of sits.kernels.gemm_small_m.GPU_CONFIGS, each row tile (BLOCK_M 16, 32, 64: the
binaries a decode batch of 1 to 64 rows uses) and both variants (plain, SiLU·mul), the kernel is
compiled as a Llama-3-8B launch specializes it (pointers 16-byte aligned; N, K and the row strides
multiples of 16; whole K tiles; M and its bucket not specialized), then the bundled ptxas assembles
the PTX for sm_90a and reports registers, spill stores / loads (CompiledKernel.n_regs needs a GPU,
hence ptxas); the shared memory comes from Triton's metadata, and "wgmma" says whether the dot became
Hopper's warpgroup MMA (else mma.sync). With --heaviest, each config only at the launch that needs the
most registers among those the autotuner keeps: the SiLU·mul variant at the widest row tile whose
pipeline fits shared memory (what tests/kernels/test_gemm_small_m_sm90.py checks). Run it without
TRITON_INTERPRET: the interpreter's kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sits.kernels import gemm_small_m

_INT_ARGS = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "M_BUCKET")
_ALIGNED = ("x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om")


def _ptxas(ptx: str) -> dict:
    """Registers and spill bytes of the PTX's kernel, from `ptxas -arch=sm_90a -v`."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                                text=True, check=False).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {"regs": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None}


def compile_one(config: triton.Config, block_m: int, silu_mul: bool, dtype: str = "bf16") -> dict:
    """One config at one row tile, compiled for sm_90a: its registers, spills and shared memory."""
    fn = gemm_small_m._small_m_gemm_kernel
    signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", **dict.fromkeys(_INT_ARGS, "i32")}
    constexprs = dict(config.kwargs, BLOCK_M=block_m, SILU_MUL=silu_mul, EVEN_K=True, DOT_FP32=False)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in _ALIGNED}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return {"config": short(config), "block_m": block_m, "silu_mul": silu_mul, "dtype": dtype,
            "shared_bytes": compiled.metadata.shared, "wgmma": "wgmma" in compiled.asm["ptx"],
            **_ptxas(compiled.asm["ptx"])}


def short(config: triton.Config) -> str:
    """A config as BLOCK_N x BLOCK_K, operand order, warps and stages (e.g. n32k256-swap-w4s4)."""
    kw = config.kwargs
    order = "swap" if kw["SWAP_AB"] else "ab"
    return f"n{kw['BLOCK_N']}k{kw['BLOCK_K']}-{order}-w{config.num_warps}s{config.num_stages}"


def launches(config: triton.Config, block_ms: list[int], heaviest: bool) -> list[tuple[bool, int]]:
    """(silu_mul, block_m) of each launch to compile for `config`: all, or only its heaviest kept one."""
    if not heaviest:
        return [(silu_mul, block_m) for silu_mul in (False, True) for block_m in block_ms]
    fitting = [b for b in block_ms if gemm_small_m.shared_memory_bytes(config, b, True) <= gemm_small_m.SMEM_BYTES]
    return [(True, max(fitting or block_ms))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--block-m", default="16,32,64", help="comma-separated row tiles")
    parser.add_argument("--heaviest", action="store_true",
                        help="each config at its heaviest kept launch only (SiLU·mul, widest fitting row tile)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    rows = []
    block_ms = [int(v) for v in args.block_m.split(",")]
    for config in gemm_small_m.GPU_CONFIGS:
        for silu_mul, block_m in launches(config, block_ms, args.heaviest):
            try:
                row = compile_one(config, block_m, silu_mul, args.dtype)
            except Exception as error:  # noqa: BLE001 - report every config
                row = {"config": short(config), "block_m": block_m, "silu_mul": silu_mul,
                       "error": f"{type(error).__name__}: {str(error)[:300]}"}
            predicted = gemm_small_m.shared_memory_bytes(config, block_m, silu_mul)
            row["kept_by_prune"] = predicted <= gemm_small_m.SMEM_BYTES
            row["predicted_shared_bytes"] = predicted
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
