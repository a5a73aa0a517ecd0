"""Fresh-prompt prefill attention as the engine would launch it (eager, no CUDA graph): cuDNN through torch SDPA
against SITS's paged and varlen Triton kernels, in the same process.

    python benchmarks/bench_prefill_cudnn_eager.py

Causal bf16, 32 query / 8 KV heads, head_dim 128, on the GPU. For each mix of prompt lengths (one engine step's
fresh prompts: no cached prefix, so K / V could be read from the step's own tensors instead of the paged cache):
  * paged: sits.kernels.attention_prefill.paged_prefill_attention over a 16-token-block cache (what the engine runs);
  * varlen: varlen_prefill_attention over the contiguous K / V;
  * cuDNN per sequence: F.scaled_dot_product_attention on the cuDNN back end, one call per prompt on [1, H, S, D]
    views of the flat tensors (enable_gqa), its output copied into place;
  * cuDNN ragged: aten._cudnn_attention_forward with cumulative lengths (one call for the step).
Printed: ms per call (CUDA events over 20 eager calls after a warm-up), TFLOP/s (4 H S^2 D / 2 per prompt), the
ratio paged / cuDNN per sequence (> 1: ours is faster), each output's relative error against the varlen kernel's,
and the first call's cost at a new prompt length (cuDNN builds an execution plan per shape).
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sits.kernels.attention_prefill import paged_prefill_attention, varlen_prefill_attention

D, HQ, HKV, BLOCK = 128, 32, 8, 16


def timed(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def per_seq_cudnn(q, k, v, bounds, scale, out):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for s, e in bounds:
            r = F.scaled_dot_product_attention(
                q[s:e].unsqueeze(0).transpose(1, 2),
                k[s:e].unsqueeze(0).transpose(1, 2),
                v[s:e].unsqueeze(0).transpose(1, 2),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[s:e].copy_(r[0].transpose(0, 1))
    return out


def ragged_cudnn(q, k, v, cu, max_len, scale):
    r = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, max_len, max_len, False, 0.0, True, False, scale=scale
    )
    return r[0]


def paged_copy(k, v, lens, bounds):
    """A 16-token-block cache holding the same K / V in shuffled blocks: (k_cache, v_cache, block_tables)."""
    blocks = [-(-n // BLOCK) for n in lens]
    perm = torch.randperm(sum(blocks), device="cuda")
    kc = torch.zeros(sum(blocks), BLOCK, HKV, D, dtype=k.dtype, device="cuda")
    vc = torch.zeros_like(kc)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    b0 = 0
    for i, (s, e) in enumerate(bounds):
        ids = perm[b0 : b0 + blocks[i]]
        tables[i, : blocks[i]] = ids.to(torch.int32)
        pad = blocks[i] * BLOCK - (e - s)
        kc[ids] = torch.cat([k[s:e], k.new_zeros(pad, HKV, D)]).view(-1, BLOCK, HKV, D)
        vc[ids] = torch.cat([v[s:e], v.new_zeros(pad, HKV, D)]).view(-1, BLOCK, HKV, D)
        b0 += blocks[i]
    return kc, vc, tables


def case(lens):
    torch.manual_seed(0)
    total = sum(lens)
    q = torch.randn(total, HQ, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(total, HKV, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(total, HKV, D, dtype=torch.bfloat16, device="cuda")
    cu_list = [0, *itertools.accumulate(lens)]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    bounds = list(itertools.pairwise(cu_list))
    scale = D**-0.5
    flops = sum(4 * HQ * n * n * D / 2 for n in lens)
    kc, vc, tables = paged_copy(k, v, lens, bounds)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out_ref, out_p, out_c = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    paths = {
        "varlen": lambda: varlen_prefill_attention(
            q, k, v, cu, cu, scale, max_query_len=max(lens), out=out_ref
        ),
        "paged": lambda: paged_prefill_attention(
            q, kc, vc, cu, seq_lens, tables, scale, max(lens), out=out_p
        ),
        "cudnn-per-seq": lambda: per_seq_cudnn(q, k, v, bounds, scale, out_c),
    }
    res = {name: timed(fn) for name, fn in paths.items()}
    torch.cuda.synchronize()

    def err(o):
        return ((o.float() - out_ref.float()).norm() / out_ref.float().norm()).item()

    line = f"lens {lens}: " + ", ".join(
        f"{n} {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)" for n, ms in res.items()
    )
    print(line, f"| paged / cuDNN per sequence {res['cudnn-per-seq'] / res['paged']:.2f}x | err paged "
          f"{err(out_p):.2e} cudnn {err(out_c):.2e}", flush=True)  # fmt: skip
    try:
        ragged_case(q, k, v, cu, max(lens), scale, flops, err)
    except RuntimeError as exc:
        print(f"  ragged cudnn failed: {str(exc)[:400]}", flush=True)


def ragged_case(q, k, v, cu, max_len, scale, flops, err):
    """cuDNN's ragged (cumulative lengths) call: ms per call, the second call's wall time, its error."""
    out = ragged_cudnn(q, k, v, cu, max_len, scale)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = ragged_cudnn(q, k, v, cu, max_len, scale)
    torch.cuda.synchronize()
    second = (time.perf_counter() - t0) * 1e3
    ms = timed(lambda: ragged_cudnn(q, k, v, cu, max_len, scale), iters=5)
    print(
        f"  ragged cudnn: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), second call wall {second:.2f} ms, "
        f"err {err(out.reshape_as(q)):.2e}",
        flush=True,
    )


def first_call_cost():
    for n in (1536, 1664, 1792, 3072):
        q = torch.randn(n, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(n, HKV, D, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        per_seq_cudnn(q, k, k, [(0, n)], D**-0.5, out)
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        per_seq_cudnn(q, k, k, [(0, n)], D**-0.5, out)
        torch.cuda.synchronize()
        second = (time.perf_counter() - t0) * 1e3
        print(f"new shape S={n}: first call {first:.1f} ms, second {second:.2f} ms", flush=True)


def main():
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name(), flush=True)
    for lens in ([2048] * 4, [1024] * 8, [512] * 16, [256] * 32, [8192], [1000, 3000, 2048, 1500], [100] * 8):
        case(lens)
    first_call_cost()


if __name__ == "__main__":
    main()
