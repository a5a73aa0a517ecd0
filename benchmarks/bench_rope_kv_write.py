"""Fused RoPE + KV-cache write on the GPU: SITS's one-launch kernel against eager PyTorch.

    python benchmarks/bench_rope_kv_write.py [--json out.json]

Llama-3-8B heads (32 q / 8 kv, head_dim 128), bf16, llama3-scaled table, 16-token blocks.
Bytes: q, k, v read; q, k written back; k, v written to the cache (cos/sin rows not counted).
The eager peer rotates q and k (rotate-half, float32 math) and index-puts k and v into the cache.
"""

from __future__ import annotations

import torch
from kernel_bench_utils import Measurement, best_peer, parse_args, report, time_ms

from sits.kernels.reference import apply_rope_reference
from sits.kernels.rope_kv_write import build_cos_sin_cache, rope_and_cache_write

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}  # fmt: skip


def bench_case(num_tokens) -> Measurement:
    dtype = torch.bfloat16
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    table = build_cos_sin_cache(HEAD_DIM, 16384, 500000.0, SCALING, device="cuda")
    positions = torch.randint(0, 16384, (num_tokens,), device="cuda")
    num_blocks = max(1, 2 * num_tokens // BLOCK)
    k_cache = torch.zeros(num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:num_tokens]
    element = q.element_size()
    num_bytes = element * HEAD_DIM * num_tokens * (2 * NUM_HEADS + 2 * NUM_KV_HEADS + 3 * NUM_KV_HEADS)

    def eager():
        q_rot = apply_rope_reference(q, positions, table)
        k_rot = apply_rope_reference(k, positions, table)
        q.copy_(q_rot)
        k.copy_(k_rot)
        k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = k_rot
        v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = v

    peer_name, peer_ms, _ = best_peer({"eager rope + index_put": eager}, num_bytes)
    ours_ms = time_ms(lambda: rope_and_cache_write(q, k, v, positions, table, k_cache, v_cache, slots))
    gbps = lambda ms: num_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    return Measurement(f"{num_tokens} tokens", "GB/s", gbps(ours_ms), gbps(peer_ms), peer_name, ours_ms, peer_ms)


def main():
    args = parse_args(__doc__)
    cases = [8192, 1024, 32] if not args.quick else [8192]
    report("Fused RoPE + KV-cache write, bf16", [bench_case(t) for t in cases], args.json)


if __name__ == "__main__":
    main()
