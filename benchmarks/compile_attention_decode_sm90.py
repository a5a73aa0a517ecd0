"""Compile the decode split kernel for the H200 (sm_90a) without a GPU, with and without the fused merge.

    python benchmarks/compile_attention_decode_sm90.py [--merge-blocks 16,64] [--queries plain,rope,f32-rope]
                                                       [--half-variants base,swap_g_f] [--quick] [--json out.json]

For each shipped bf16 config (sits.kernels.decode_schedules.BF16_CONFIGS) and the fp8 default schedule
(FP8_CONFIGS, DEFAULT_FP8_VARIANT), the split kernel is compiled as a Llama-3-8B launch specializes it
(32 query / 8 KV heads, head_dim 128, 16-token pages, several splits): the two-launch variant (partials
only) and the fused-merge variant at each merge size (BLOCK_S 16: batch 1 at a 4k context; 64: the most
splits), for each query kind: "plain" (bf16 q, rotated before), "rope" (the RoPE + KV write fused in,
DecodeRope) and "f32-rope" (float32 q and output, fused RoPE: the float32-activation mode); the bf16 configs
at each of --half-variants (the bf16 cache's inner loops, HALF_DECODE_VARIANTS; "base" by default). The bundled
ptxas assembles the PTX for sm_90a and reports registers and spill bytes (CompiledKernel.n_regs needs a
GPU, hence ptxas); shared memory comes from Triton's metadata. --quick: the fp8 default and the first and
last bf16 configs (the last holds the most shared memory). Run it without TRITON_INTERPRET: the
interpreter's kernels cannot be compiled.
"""

from __future__ import annotations

import argparse

import triton
from sm90_compile import compile_sm90, report_rows

from sits.kernels import attention_decode as ad
from sits.kernels import decode_schedules as schedules
from sits.kernels.launch_utils import next_power_of_2

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
GROUP = NUM_Q_HEADS // NUM_KV_HEADS
# The launch's 16-divisible arguments that Triton specializes (those in _VARYING_INTS / _VARYING_POINTERS are not).
_ALIGNED = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "partial_out_ptr", "partial_lse_ptr", "stride_q_seq",
            "stride_q_head", "stride_k_block", "stride_k_slot", "stride_k_head", "stride_v_block", "stride_v_slot",
            "stride_v_head", "stride_o_seq", "stride_o_head")


QUERIES = ("plain", "rope", "f32-rope")


def split_kernel_launch(config: triton.Config, fp8: bool, merge_block: int, query: str = "plain",
                        half_variant: str = schedules.DEFAULT_HALF_VARIANT) -> tuple[dict, dict]:
    """(types, constexprs) of the split kernel's Llama-3-8B launch at one config (merge_block: see compile_one;
    query: one of QUERIES; half_variant: the bf16 cache's inner loop, a key of HALF_DECODE_VARIANTS)."""
    cache = "*fp8e4nv" if fp8 else "*bf16"
    activation = "*fp32" if query.startswith("f32") else "*bf16"
    new_kv = activation if query.endswith("rope") else "*i32"
    types = {"q_ptr": activation, "k_cache_ptr": cache, "v_cache_ptr": cache, "block_tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "out_ptr": activation, "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
             "k_scale_ptr": "*fp32" if fp8 else "*i32", "v_scale_ptr": "*fp32" if fp8 else "*i32",
             "split_counters_ptr": "*i32", "qk_scale": "fp32", "k_new_ptr": new_kv, "v_new_ptr": new_kv,
             "positions_ptr": "*i64" if query.endswith("rope") else "*i32",
             "cos_sin_ptr": "*fp32" if query.endswith("rope") else "*i32",
             "slot_ptr": "*i64" if query.endswith("rope") else "*i32"}
    variant = schedules.FP8_DECODE_VARIANTS[schedules.DEFAULT_FP8_VARIANT] if fp8 else schedules.HALF_DECODE_VARIANTS[half_variant]
    group_rows = next_power_of_2(GROUP) if variant & schedules.GROUP_ROWS else max(16, next_power_of_2(GROUP))
    constexprs = dict(config.kwargs, HEAD_DIM=HEAD_DIM, BLOCK_G=group_rows, PAGE_SIZE=PAGE_SIZE, SINGLE_SPLIT=False,
                      FP8_KV=fp8, FP8_F16=fp8, VARIANT=variant, FUSED_MERGE=merge_block > 0,
                      MERGE_BLOCK=merge_block or 1, MERGE_G=next_power_of_2(GROUP) if merge_block else 1,
                      ROTARY_DIM=HEAD_DIM if query.endswith("rope") else 0, F32_TERMS=query.startswith("f32"))
    return types, constexprs


def compile_one(config: triton.Config, fp8: bool, merge_block: int, query: str = "plain",
                half_variant: str = schedules.DEFAULT_HALF_VARIANT) -> dict:
    """The split kernel at one config: fused merge of BLOCK_S merge_block, or (0) the two-launch variant."""
    types, constexprs = split_kernel_launch(config, fp8, merge_block, query, half_variant)
    figures = compile_sm90(ad._decode_split_kernel.fn, types, constexprs, _ALIGNED, config)
    figures.pop("wgmma")
    return figures


def _describe(config: triton.Config, fp8: bool, merge_block: int, query: str = "plain",
              half_variant: str = schedules.DEFAULT_HALF_VARIANT) -> dict:
    return {"cache": "fp8" if fp8 else "bf16", "schedule": "/".join(map(str, schedules.schedule_of(config))),
            "fused_merge_block": merge_block, "query": query, "variant": schedules.DEFAULT_FP8_VARIANT if fp8 else half_variant}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--merge-blocks", default="16,64", help="comma-separated fused-merge BLOCK_S values")
    parser.add_argument("--queries", default=",".join(QUERIES), help=f"comma-separated, of {', '.join(QUERIES)}")
    parser.add_argument("--quick", action="store_true",
                        help="the fp8 default and the first and last bf16 configs only (the last: the most shared memory)")
    parser.add_argument("--half-variants", default=schedules.DEFAULT_HALF_VARIANT,
                        help=f"comma-separated bf16-cache inner loops, of {', '.join(sorted(schedules.HALF_DECODE_VARIANTS))}")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    half_variants = args.half_variants.split(",")
    launches = [(c, False, v) for c in schedules.BF16_CONFIGS for v in half_variants]
    launches += [(c, True, schedules.DEFAULT_HALF_VARIANT) for c in schedules.FP8_CONFIGS]
    if args.quick:
        launches = [launches[0], launches[len(schedules.BF16_CONFIGS) * len(half_variants) - 1], launches[-1]]
    blocks = [0] + [int(v) for v in args.merge_blocks.split(",")]
    queries = args.queries.split(",")
    report_rows([(config, fp8, block, query, variant) for config, fp8, variant in launches for block in blocks
                 for query in queries], _describe, compile_one, args.json)


if __name__ == "__main__":
    main()
