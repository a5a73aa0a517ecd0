"""Prefill attention on the GPU: SITS's varlen and paged kernels against SDPA (FA2, cuDNN) and FlexAttention.

    python benchmarks/bench_attention_prefill.py [--json out.json]

Causal, bf16, head_dim 128. FLOPs = 4 * B * H * S^2 * D / 2 (the causal half of QK^T and PV).
The peers run on padded [B, H, S, D] tensors, our kernels on the same tokens as a flat batch
(cu_seqlens); the paged case reads K/V through block tables from a 16-token-block cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_bench_utils import Measurement, best_peer, parse_args, report, time_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

from sits.kernels.attention_prefill import paged_prefill_attention, varlen_prefill_attention

HEAD_DIM = 128


def _flex_attention():
    """Compiled FlexAttention with a causal block mask, or None where unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, seq_len, gqa):
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq_len, seq_len, device="cuda")
        return lambda: compiled(q, k, v, block_mask=mask, enable_gqa=gqa)

    return run


def _sdpa(q, k, v, backend, gqa):
    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return run


def bench_case(batch, seq_len, num_heads, num_kv_heads, flex) -> list[Measurement]:
    gqa = num_heads != num_kv_heads
    dtype = torch.bfloat16
    scale = HEAD_DIM**-0.5
    q = torch.randn(batch, num_heads, seq_len, HEAD_DIM, dtype=dtype, device="cuda")
    k = torch.randn(batch, num_kv_heads, seq_len, HEAD_DIM, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    flops = 4 * batch * num_heads * seq_len * seq_len * HEAD_DIM / 2
    peers = {
        "SDPA flash (FA2)": _sdpa(q, k, v, SDPBackend.FLASH_ATTENTION, gqa),
        "SDPA cuDNN": _sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION, gqa),
    }
    if flex is not None:
        peers["FlexAttention"] = flex(q, k, v, seq_len, gqa)
    peer_name, peer_ms, all_ms = best_peer(peers, flops)

    flat_q = q.transpose(1, 2).reshape(batch * seq_len, num_heads, HEAD_DIM).contiguous()
    flat_k = k.transpose(1, 2).reshape(batch * seq_len, num_kv_heads, HEAD_DIM).contiguous()
    flat_v = v.transpose(1, 2).reshape(batch * seq_len, num_kv_heads, HEAD_DIM).contiguous()
    cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device="cuda")
    out = torch.empty_like(flat_q)
    varlen_ms = time_ms(
        lambda: varlen_prefill_attention(flat_q, flat_k, flat_v, cu, cu, scale, max_query_len=seq_len, out=out)
    )
    block = 16
    blocks_per_seq = seq_len // block
    perm = torch.randperm(batch * blocks_per_seq, device="cuda")
    k_cache = torch.empty(batch * blocks_per_seq, block, num_kv_heads, HEAD_DIM, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = flat_k.view(-1, block, num_kv_heads, HEAD_DIM)
    v_cache[perm] = flat_v.view(-1, block, num_kv_heads, HEAD_DIM)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    paged_ms = time_ms(
        lambda: paged_prefill_attention(flat_q, k_cache, v_cache, cu, seq_lens, tables, scale, seq_len, out=out)
    )
    reference = peers[peer_name]().transpose(1, 2).reshape_as(out)
    varlen_prefill_attention(flat_q, flat_k, flat_v, cu, cu, scale, max_query_len=seq_len, out=out)
    error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()

    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    case = f"B{batch} S{seq_len} H{num_heads}/{num_kv_heads}"
    extra = {name: round(tflops(ms), 1) for name, ms in all_ms.items()} | {"rel_err_vs_peer": error}
    fa2_ms = all_ms.get("SDPA flash (FA2)")
    rows = [
        Measurement(f"{case} varlen", "TFLOP/s", tflops(varlen_ms), tflops(peer_ms), peer_name, varlen_ms, peer_ms, extra),
        Measurement(f"{case} paged16", "TFLOP/s", tflops(paged_ms), tflops(peer_ms), peer_name, paged_ms, peer_ms, extra),
    ]
    if fa2_ms:
        rows.append(
            Measurement(f"{case} varlen vs FA2", "TFLOP/s", tflops(varlen_ms), tflops(fa2_ms), "SDPA flash (FA2)",
                        varlen_ms, fa2_ms)
        )  # fmt: skip
    print(f"{case}: " + ", ".join(f"{n} {v}" for n, v in extra.items()), flush=True)
    return rows


def main():
    args = parse_args(__doc__)
    flex = _flex_attention()
    cases = [(4, 2048, 32, 32), (2, 4096, 32, 32), (1, 8192, 32, 32), (4, 2048, 32, 8), (1, 8192, 32, 8)]
    if args.quick:
        cases = cases[:1]
    rows = []
    for case in cases:
        rows += bench_case(*case, flex)
        torch.cuda.empty_cache()
    report("Prefill attention, causal bf16, head_dim 128", rows, args.json)


if __name__ == "__main__":
    main()
