"""The decode step's kernels one launch each, for Nsight Compute: Llama-3-8B shapes, bf16, the committed small-M table.

    ncu --profile-from-start off --clock-control none --cache-control all --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \\
        python benchmarks/ncu_decode_kernels.py --m 1,32
    (benchmarks/gpu_profile_run.sh's step `ncu`)

For each batch M: qkv_proj, o_proj, gate_up + SiLU·mul and down_proj on the launch the table names at that bucket
(the direct or split-K kernel with its pinned config, or cuBLAS through F.linear), then decode attention over a
2,048-token paged context (32 query / 8 KV heads, 16-token blocks). Each is launched once before profiling (so
compiling and autotuning stay outside it) and once between cudaProfilerStart and cudaProfilerStop, so ncu sees
exactly one launch of each. ncu times a kernel alone, its caches flushed (cold weights, as in a decode step), without
the launch gaps of a CUDA graph: set its duration beside the per-call time of bench_gemm_small_m.py (graphs) to
see what a launch costs beyond its own run. Its print names the launches in order.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_gemm_small_m import LLAMA3_8B
from bench_gemm_small_m_streamk import table_launch

from sits.kernels.attention_decode import DecodeRope, paged_decode_attention
from sits.kernels.gemm_small_m import small_m_gemm_silu_mul
from sits.kernels.gemm_small_m_splitk import counters_needed
from sits.kernels.rope_kv_write import build_cos_sin_cache
from sits.kernels.small_m_table import load_small_m_table, m_bucket

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CONTEXT, BLOCK = 2048, 16


def projection_launch(name: str, m: int, table) -> tuple[str, Callable[[], object]]:
    """(what runs, a callable launching it once) for one projection at M rows, as the table routes it."""
    n, k = LLAMA3_8B[name]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    if name == "gate_up":
        bucket = m_bucket(m)
        config = table.pinned_configs("silu_mul", n, k).get(bucket)
        if bucket in table.direct_buckets("silu_mul", n, k):
            return f"direct+silu {config}", lambda: small_m_gemm_silu_mul(x, w, config=config)
        return "cublas (then silu_mul)", lambda: F.linear(x, w)
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
    what, launch = table_launch(n, k, m, table, counters)
    return what, lambda: launch(x, w)


def attention_launch(m: int) -> tuple[str, Callable[[], object]]:
    """Decode attention of M sequences over CONTEXT tokens each (the split plan the kernel picks), with the
    decode RoPE + KV write fused in as the engine launches it (the new token at position CONTEXT - 1)."""
    blocks = CONTEXT // BLOCK
    k_cache = torch.randn(m * blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(m * blocks, device="cuda").to(torch.int32).view(m, blocks)
    seq_lens = torch.full((m,), CONTEXT, dtype=torch.int32, device="cuda")
    q = torch.randn(m, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k_new, v_new = (torch.randn(m, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    positions = torch.full((m,), CONTEXT - 1, dtype=torch.int64, device="cuda")
    slots = tables[:, (CONTEXT - 1) // BLOCK].long() * BLOCK + (CONTEXT - 1) % BLOCK
    rope = DecodeRope(
        k_new, v_new, positions, build_cos_sin_cache(HEAD_DIM, CONTEXT + BLOCK, device="cuda"), slots
    )
    return "decode attention + RoPE", lambda: paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5, max_seq_len=CONTEXT, rope=rope
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--attention-only", action="store_true", help="decode attention's launches only")
    args = parser.parse_args()
    table = load_small_m_table(device_name=torch.cuda.get_device_name())
    launches = []
    for m in (int(v) for v in args.m.split(",")):
        if not args.attention_only:
            launches += [(f"M{m} {name}", *projection_launch(name, m, table)) for name in LLAMA3_8B]
        launches.append((f"M{m} attention", *attention_launch(m)))
    for _, _, launch in launches:  # compile and autotune before profiling
        launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for case, what, launch in launches:
        print(f"profiled: {case}: {what}", flush=True)
        launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
