"""Compile every launch of the fused add + RMSNorm + e4m3 quantization for the H200 (sm_90a) without a GPU.

    python benchmarks/compile_rmsnorm_quant_sm90.py [--dtype bf16] [--json out.json]

sits.kernels.rmsnorm_quant is not autotuned: a hidden size gives one (BLOCK, num_warps, single pass) through
`launch_config`. For the hidden sizes of the models we serve (576 SmolLM2-135M, 2,048, 4,096 Llama-3-8B,
8,192 Llama-3-70B, 16,384 the widest single pass) and one wider than that (three passes), each stream case is
compiled as the decoder launches it (a float32 residual added in place; the first layer's stream started from
x in float32; a stream in the model dtype, nothing written), then ptxas reports registers and spills
(benchmarks/sm90_compile.py). Run it without TRITON_INTERPRET; with PYTHONPATH pointing at another
Triton to check that version.
"""

from __future__ import annotations

import argparse

import triton
from sm90_compile import compile_sm90, report_rows

from sits.kernels import rmsnorm_quant

HIDDEN_SIZES = (576, 2048, 4096, 8192, 16384, 20480)
STREAMS = {"add": (True, True), "start": (False, True), "model_dtype": (False, False)}  # HAS_, WRITE_RESIDUAL
_ALIGNED = ("x_ptr", "weight_ptr", "residual_ptr", "residual_out_ptr", "out_ptr", "stride_x", "stride_res",
            "stride_res_out", "stride_out", "n_cols")


def compile_one(hidden: int, stream: str, dtype: str = "bf16") -> dict:
    """One launch compiled for sm_90a as a model of this hidden size specializes it: registers and spills."""
    block, warps, single = rmsnorm_quant.launch_config(hidden)
    has_residual, write_residual = STREAMS[stream]
    stream_ty = "*fp32" if write_residual else f"*{dtype}"
    types = {"x_ptr": f"*{dtype}", "weight_ptr": f"*{dtype}", "residual_ptr": stream_ty,
             "residual_out_ptr": stream_ty, "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "eps": "fp32"}
    constexprs = {"BLOCK": block, "HAS_RESIDUAL": has_residual, "WRITE_RESIDUAL": write_residual,
                  "SINGLE_PASS": single}
    figures = compile_sm90(rmsnorm_quant._rms_norm_quant_kernel, types, constexprs, _ALIGNED,
                           triton.Config({}, num_warps=warps, num_stages=3))
    figures.pop("wgmma")
    return {"block": block, "num_warps": warps, "single_pass": single, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    todo = [(hidden, stream, args.dtype) for hidden in HIDDEN_SIZES for stream in STREAMS]
    report_rows(todo, lambda hidden, stream, dtype: {"triton": triton.__version__, "hidden": hidden, "stream": stream},
                compile_one, args.json)


if __name__ == "__main__":
    main()
