"""Decode attention on the GPU: SITS's paged split-KV kernel against SDPA over a contiguous cache.

    python benchmarks/bench_attention_decode.py [--json out.json]

One query token per sequence, GQA 32 query / 8 KV heads, head_dim 128, bf16. The figure is the
effective bandwidth: bytes of live K and V (B * context * Hkv * D * 2 tensors * 2 bytes) over the
time. SITS reads them through block tables from a 16-token-block paged cache (blocks shuffled);
SDPA reads a contiguous [B, Hkv, S, D] cache holding exactly the live tokens (its best case).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_bench_utils import Measurement, best_peer, parse_args, report, time_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

from sits.kernels.attention_decode import choose_num_splits, paged_decode_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def _sdpa(q, k, v, backend=None):
    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def bench_case(batch, context, block_size, sweep_splits) -> tuple[list[Measurement], list[str]]:
    dtype = torch.bfloat16
    scale = HEAD_DIM**-0.5
    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, dtype=dtype, device="cuda")
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    kv_bytes = 2 * k.numel() * k.element_size()
    peers = {
        "SDPA (default)": _sdpa(q, k, v),
        "SDPA flash": _sdpa(q, k, v, SDPBackend.FLASH_ATTENTION),
        "SDPA efficient": _sdpa(q, k, v, SDPBackend.EFFICIENT_ATTENTION),
        "SDPA cuDNN": _sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION),
    }
    peer_name, peer_ms, all_ms = best_peer(peers, kv_bytes)

    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, device="cuda")
    k_cache = torch.empty(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = k.permute(0, 2, 1, 3).reshape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    v_cache[perm] = v.permute(0, 2, 1, 3).reshape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    flat_q = q[:, :, 0].contiguous()
    out = torch.empty_like(flat_q)
    auto = choose_num_splits(batch, NUM_KV_HEADS, context, q.device)
    split_ms = {}
    for splits in sorted({auto, *(sweep_splits if sweep_splits else ())}):
        split_ms[splits] = time_ms(
            lambda s=splits: paged_decode_attention(flat_q, k_cache, v_cache, tables, seq_lens, scale, out=out, num_splits=s)
        )
    ours_ms = split_ms[auto]
    paged_decode_attention(flat_q, k_cache, v_cache, tables, seq_lens, scale, out=out)
    reference = peers["SDPA (default)"]()[:, :, 0]
    error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    gbps = lambda ms: kv_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    case = f"B{batch} ctx{context} block{block_size}"
    extra = {n: round(gbps(ms), 1) for n, ms in all_ms.items()} | {"rel_err": error, "auto_splits": auto}
    note = f"{case} splits sweep (GB/s): " + ", ".join(f"{s}: {gbps(ms):,.0f}" for s, ms in split_ms.items())
    print(note, "| peers:", extra, flush=True)
    row = Measurement(case, "GB/s", gbps(ours_ms), gbps(peer_ms), peer_name, ours_ms, peer_ms, extra)
    return [row], [note]


def main():
    args = parse_args(__doc__)
    sweep = (1, 2, 4, 8, 16)
    cases = [(32, 2048, 16), (32, 2048, 64), (32, 8192, 16), (128, 2048, 16), (8, 4096, 16), (1, 16384, 16)]
    if args.quick:
        cases = cases[:1]
    rows, notes = [], []
    for batch, context, block in cases:
        r, n = bench_case(batch, context, block, sweep)
        rows += r
        notes += n
        torch.cuda.empty_cache()
    report("Decode attention, bf16, 32 q / 8 kv heads, head_dim 128", rows, args.json, notes)


if __name__ == "__main__":
    main()
