"""Compile sits.kernels.fused_mlp's launch for the H200 (sm_90a) at bench_fused_mlp.py's configs, and say whether
each grid is resident at once.

    python benchmarks/compile_fused_mlp_sm90.py [--json out.json]

The kernel as `fused_decode_mlp` specializes it at Llama-3-8B's shapes (bf16 weights, one row). Rows give
registers, spills and shared memory (see sm90_compile.py), the programs an SM holds by each (the H200's 64 K
registers, allocated per thread in steps of 8; 228 KB of shared memory, 1 KB of it reserved a program; 2,048
threads), the grid (one program a down unit) and whether it fits 132 SMs at once, as `fits_at_once` decides on the
GPU. A grid that does not fit is refused by the cooperative launch. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse

import triton
from bench_fused_mlp import CONFIGS, HIDDEN, INTERMEDIATE
from sm90_compile import compile_sm90, report_rows

from sits.kernels import fused_mlp
from sits.kernels.gemm_small_m import sumsq_slots

SMS = 132
REGISTERS, SHARED, THREADS = 65536, 228 * 1024, 2048
TYPES = {name: "*bf16" for name in ("x_ptr", "w_gate_up_ptr", "w_down_ptr", "out_ptr", "h_ptr")}
TYPES |= {name: "*fp32" for name in ("sumsq_ptr", "stream_ptr", "sumsq_out_ptr", "ws_ptr")}
TYPES |= {"tiles_ptr": "*i32", "barrier_ptr": "*i32", "eps": "fp32"}
ALIGNED = [*TYPES.keys() - {"eps"}, "K", "INTER", "N", "stride_xm", "stride_hm", "stride_sm", "stride_om"]


def compile_one(config: dict) -> dict:
    launch = {key: value for key, value in config.items() if key not in ("num_warps", "num_stages")}
    constexprs = {**launch, "PREFETCH": config.get("PREFETCH", 0), "DOT_FP32": False,
                  "RSTD_SLOTS": triton.next_power_of_2(sumsq_slots(HIDDEN))}
    row = compile_sm90(fused_mlp._fused_mlp_kernel, TYPES, constexprs, ALIGNED,
                       triton.Config({}, num_warps=config["num_warps"], num_stages=config["num_stages"]))
    threads = 32 * config["num_warps"]
    per_sm = min(REGISTERS // (-(-row["regs"] // 8) * 8 * threads), SHARED // (row["shared_bytes"] + 1024),
                 THREADS // threads)
    grid = HIDDEN // config["BLOCK_N"] * config["K_SPLIT"]
    return row | {"programs_an_sm": per_sm, "grid": grid, "fits_at_once": grid <= per_sm * SMS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    report_rows([(config,) for config in CONFIGS], lambda config: {"config": config, "intermediate": INTERMEDIATE},
                compile_one, args.json)


if __name__ == "__main__":
    main()
