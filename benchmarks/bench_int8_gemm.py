"""INT8 weight-only GEMM on the GPU: SITS's W8A16 kernel against bf16 cuBLAS on the unquantized weight.

    python benchmarks/bench_int8_gemm.py [--json out.json]

x [M, K] bf16, w_int8 [N, K] with per-group (128) float32 scales. FLOPs = 2 M N K. The peers:
`x @ w_bf16.T` (what a model runs without quantization; it reads twice the weight bytes) and eager
dequantize-then-matmul. Decode-sized M is where weight-only quantization pays: half the bytes.
"""

from __future__ import annotations

import torch
from kernel_bench_utils import Measurement, best_peer, parse_args, report, rotating, time_ms

from sits.kernels.int8_gemm import int8_weight_only_gemm, quantize_weight_int8
from sits.kernels.reference import int8_weight_only_gemm_reference

L2_DEFEAT_BYTES = 256 << 20
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def bench_gemm(m, n, k, label) -> Measurement:
    copies = max(1, min(8, L2_DEFEAT_BYTES // (2 * n * k)))
    sets = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda") * 0.02
        w_int8, scales = quantize_weight_int8(w)
        sets.append((torch.randn(m, k, dtype=torch.bfloat16, device="cuda"), w.to(torch.bfloat16), w_int8, scales))
    peers = {
        "bf16 cuBLAS (unquantized)": rotating(lambda i: sets[i][0] @ sets[i][1].t(), copies),
        "eager dequant + matmul": rotating(lambda i: int8_weight_only_gemm_reference(sets[i][0], sets[i][2], sets[i][3]), copies),
    }
    peer_name, peer_ms, all_ms = best_peer(peers, 2 * m * n * k)
    ours_ms = time_ms(rotating(lambda i: int8_weight_only_gemm(sets[i][0], sets[i][2], sets[i][3]), copies))
    tflops = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e12  # noqa: E731
    weight_gbps = n * k / (ours_ms * 1e-3) / 1e9
    extra = {name: round(tflops(ms), 1) for name, ms in all_ms.items()} | {"int8_weight_GBps": round(weight_gbps)}
    return Measurement(f"{label} M{m} N{n} K{k}", "TFLOP/s", tflops(ours_ms), tflops(peer_ms), peer_name, ours_ms, peer_ms, extra)


def main():
    args = parse_args(__doc__)
    rows = []
    m_values = (1, 32, 2048) if not args.quick else (32,)
    for name, (n, k) in LLAMA3_8B.items():
        for m in m_values:
            rows.append(bench_gemm(m, n, k, name))
            print(rows[-1], flush=True)
    report("INT8 weight-only GEMM (W8A16, group 128), bf16", rows, args.json)


if __name__ == "__main__":
    main()
