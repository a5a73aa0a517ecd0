"""Compile the decode path's kernels for the H200 (sm_90a) with and without programmatic dependent launch.

    python benchmarks/compile_pdl_sm90.py [--only TEXT] [--json out.json]

Each kernel that takes USE_PDL (sits.kernels.pdl), at a Llama-3-8B decode launch: the fused add + RMSNorm,
the small-M GEMM (plain and with SiLU·mul), RoPE + KV write, the decode split kernel and its merge, SiLU·mul,
greedy argmax's two kernels, and the fp8 path's (the fused add + RMSNorm + e4m3 quantization, SiLU·mul + e4m3,
per-token e4m3, the direct and the split-K fp8 GEMMs), each compiled with USE_PDL in each of its three modes
(PDL_OFF, PDL_AT_EXIT, PDL_EARLY). Rows give how many grid-dependency instructions (`griddepcontrol.*`) the PTX
holds: none off, the wait at exit-trigger, the wait and the early trigger with PDL_EARLY, and registers and
spills each way (the wait must not cost registers). --only TEXT: the kernels whose name contains TEXT. Run it
without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse

import triton
from compile_attention_decode_sm90 import split_kernel_launch
from sm90_compile import compile_sm90, report_rows

from sits.kernels import (
    argmax,
    attention_decode,
    decode_merge,
    decode_schedules,
    fp8_gemm,
    fp8_quantize,
    gemm_small_m,
    pdl,
    rmsnorm,
    rmsnorm_quant,
    rope_kv_write,
    silu_mul,
)

HIDDEN, HEAD_DIM, Q_HEADS, KV_HEADS, PAGE_SIZE = 4096, 128, 32, 8, 16


def _launches() -> dict[str, tuple]:
    """name -> (jit function, types, constexprs, aligned arguments, config) of each kernel's launch."""
    return _bf16_launches() | _fp8_launches()


def _bf16_launches() -> dict[str, tuple]:
    """The bf16 decode path's kernels (see _launches)."""
    small_m = gemm_small_m.GPU_CONFIGS[0]
    split_config = decode_schedules.BF16_CONFIGS[0]
    split_types, split_constexprs = split_kernel_launch(split_config, False, 0)
    half = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    return {
        "rms_norm (fused add)": (
            rmsnorm._rms_norm_kernel.fn,
            {"x_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "residual_ptr": "*fp32",
             "residual_out_ptr": "*fp32", "eps": "fp32"},
            {"BLOCK_N": HIDDEN, "HAS_RESIDUAL": True, "WRITE_RESIDUAL": True}, (), triton.Config({}, num_warps=8)),
        "small-M GEMM": (
            gemm_small_m._small_m_gemm_kernel, half,
            dict(small_m.kwargs, BLOCK_M=16, SILU_MUL=False, EVEN_K=True, DOT_FP32=False), (), small_m),
        "small-M GEMM + SiLU·mul": (
            gemm_small_m._small_m_gemm_kernel, half,
            dict(small_m.kwargs, BLOCK_M=16, SILU_MUL=True, EVEN_K=True, DOT_FP32=False), (), small_m),
        "RoPE + KV write": (
            rope_kv_write._rope_cache_write_kernel,
            {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32",
             "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64", "k_scale_ptr": "*fp32",
             "v_scale_ptr": "*fp32"},
            {"HEAD_DIM": HEAD_DIM, "ROTARY_DIM": HEAD_DIM, "BLOCK_HQ": Q_HEADS, "BLOCK_HKV": KV_HEADS,
             "BLOCK_HALF": HEAD_DIM // 2, "BLOCK_D": HEAD_DIM, "PAGE_SIZE": PAGE_SIZE, "FP8_CACHE": False},
            (), triton.Config({}, num_warps=4)),
        "decode split": (attention_decode._decode_split_kernel.fn, split_types, split_constexprs, (), split_config),
        "decode merge": (
            decode_merge.decode_merge_kernel,
            {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16"},
            {"HEAD_DIM": HEAD_DIM, "BLOCK_S": 16}, (), triton.Config({}, num_warps=4)),
        "SiLU·mul": (
            silu_mul._silu_mul_kernel, {"gate_up_ptr": "*bf16", "out_ptr": "*bf16"}, {"BLOCK": silu_mul.BLOCK_F},
            (), triton.Config({}, num_warps=4)),
        "argmax chunk": (
            argmax._argmax_chunk_kernel, {"logits_ptr": "*fp32", "key_ptr": "*i32", "index_ptr": "*i32"},
            {"BLOCK": argmax.BLOCK}, (), triton.Config({}, num_warps=4)),
        "argmax merge": (
            argmax._argmax_merge_kernel, {"key_ptr": "*i32", "index_ptr": "*i32", "out_ptr": "*i64"},
            {"BLOCK_C": argmax.MAX_CHUNKS}, (), triton.Config({}, num_warps=1)),
    }


def _fp8_launches() -> dict[str, tuple]:
    """The fp8 decode path's kernels (see _launches)."""
    fp8_types = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32"}
    return {
        "fp8 direct GEMM": (
            fp8_gemm._fp8_gemm_direct_kernel, fp8_types | {"c_ptr": "*bf16"},
            dict(fp8_gemm._DIRECT_CONFIGS[0].kwargs, BLOCK_M=16, FAST_ACCUM=False, EVEN_K=True), (),
            fp8_gemm._DIRECT_CONFIGS[0]),
        "fp8 split-K GEMM": (
            fp8_gemm._fp8_gemm_kernel, fp8_types | {"c_ptr": "*fp32"},
            dict(fp8_gemm._SMALL_M_CONFIGS[0].kwargs, ATOMIC=True, FAST_ACCUM=False, EVEN_K=True), (),
            fp8_gemm._SMALL_M_CONFIGS[0]),
        "rms_norm + e4m3": (
            rmsnorm_quant._rms_norm_quant_kernel,
            {"x_ptr": "*bf16", "weight_ptr": "*bf16", "residual_ptr": "*fp32", "residual_out_ptr": "*fp32",
             "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "eps": "fp32"},
            {"BLOCK": HIDDEN, "HAS_RESIDUAL": True, "WRITE_RESIDUAL": True, "SINGLE_PASS": True}, (),
            triton.Config({}, num_warps=rmsnorm_quant.launch_config(HIDDEN)[1])),
        "SiLU·mul + e4m3": (
            silu_mul._silu_mul_quant_kernel, {"gate_up_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
            {"BLOCK": 16384, "SINGLE_PASS": True}, (), triton.Config({}, num_warps=16)),
        "per-token e4m3": (
            fp8_quantize._quantize_fp8_per_token_kernel, {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
            {"BLOCK": HIDDEN, "SINGLE_PASS": True}, (), triton.Config({}, num_warps=16)),
    }


PDL_MODES = (pdl.PDL_OFF, pdl.PDL_AT_EXIT, pdl.PDL_EARLY)


def compile_one(name: str, use_pdl: int) -> dict:
    """One kernel's launch compiled for sm_90a with USE_PDL in one of PDL_MODES."""
    fn, types, constexprs, aligned, config = _launches()[name]
    return compile_sm90(fn, types, dict(constexprs, USE_PDL=use_pdl), aligned, config)


def _describe(name: str, use_pdl: int) -> dict:
    return {"kernel": name, "use_pdl": use_pdl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--only", help="the kernels whose name contains this text (default: all)")
    args = parser.parse_args()
    names = [name for name in _launches() if args.only is None or args.only in name]
    report_rows([(name, pdl_mode) for name in names for pdl_mode in PDL_MODES], _describe, compile_one, args.json)


if __name__ == "__main__":
    main()
