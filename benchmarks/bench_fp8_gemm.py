"""FP8 GEMM on the GPU: SITS's scaled e4m3 GEMM against torch._scaled_mm (cuBLASLt), same scales.

    python benchmarks/bench_fp8_gemm.py [--json out.json]

a_fp8 [M, K] with per-token scales [M, 1], w_fp8 [N, K] with per-channel scales, bf16 out.
FLOPs = 2 M N K. Both sides promote the fp8 tensor-core sums to float32 every 128 K elements
(torch._scaled_mm's default); a few cases also run both with fast accumulation. Shapes: 8192^3 and Llama-3-8B's projections (qkv 6144x4096, o 4096x4096,
gate_up 28672x4096, down 4096x14336) for M from 32 to 8192. Small problems rotate through
several weight copies so neither side is timed out of L2. Also: the activation quantizer's
bandwidth against an eager PyTorch quantizer.
"""

from __future__ import annotations

import torch
from kernel_bench_utils import Measurement, best_peer, parse_args, report, rotating, time_ms

from sits.kernels.fp8_gemm import fp8_gemm, quantize_weight_fp8_per_channel
from sits.kernels.fp8_quantize import quantize_fp8_per_token, quantize_fp8_per_token_reference

L2_DEFEAT_BYTES = 256 << 20
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def bench_gemm(m, n, k, label, fast_accum=False) -> Measurement:
    copies = max(1, min(8, L2_DEFEAT_BYTES // (n * k + m * k)))
    sets = []
    for _ in range(copies):
        a_fp8, a_scale = quantize_fp8_per_token(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"))
        w_fp8, w_scale = quantize_weight_fp8_per_channel(torch.randn(n, k, device="cuda") * 0.02)
        sets.append((a_fp8, a_scale, w_fp8, w_scale, w_scale.reshape(1, -1).contiguous()))

    def scaled_mm(i):
        a, sa, w, _, sw_row = sets[i]
        return torch._scaled_mm(
            a, w.t(), scale_a=sa, scale_b=sw_row, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
        )

    def ours(i, use_tma=None):
        a, sa, w, sw, _ = sets[i]
        return fp8_gemm(a, sa, w, sw, use_tma=use_tma, fast_accum=fast_accum)

    peer = "torch._scaled_mm" + (" fast_accum" if fast_accum else "")
    peer_name, peer_ms, _ = best_peer({peer: rotating(scaled_mm, copies)}, 2 * m * n * k)
    ours_ms = time_ms(rotating(ours, copies))
    extra = {"weight_copies": copies}
    if m > 128:  # the pointer kernel, for the record
        extra["pointer_kernel_tflops"] = round(2 * m * n * k / (time_ms(rotating(lambda i: ours(i, False), copies)) * 1e-3) / 1e12, 1)
    err = ((ours(0).float() - scaled_mm(0).float()).norm() / scaled_mm(0).float().norm()).item()
    extra["rel_err_vs_scaled_mm"] = err
    tflops = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e12  # noqa: E731
    label = f"{label} fast-accum" if fast_accum else label
    return Measurement(f"{label} M{m} N{n} K{k}", "TFLOP/s", tflops(ours_ms), tflops(peer_ms), peer_name, ours_ms, peer_ms, extra)


def bench_quantize(m, k) -> Measurement:
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    num_bytes = m * k * (2 + 1) + m * 4
    peer_name, peer_ms, _ = best_peer({"eager quantize": lambda: quantize_fp8_per_token_reference(x)}, num_bytes)
    ours_ms = time_ms(lambda: quantize_fp8_per_token(x))
    gbps = lambda ms: num_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    return Measurement(f"quantize {m}x{k}", "GB/s", gbps(ours_ms), gbps(peer_ms), peer_name, ours_ms, peer_ms)


def main():
    args = parse_args(__doc__)
    rows = [bench_gemm(8192, 8192, 8192, "square")]
    print(rows[-1], flush=True)
    m_values = (32, 256, 2048, 8192) if not args.quick else (32,)
    for name, (n, k) in LLAMA3_8B.items():
        for m in m_values:
            rows.append(bench_gemm(m, n, k, name))
            print(rows[-1], flush=True)
    # Both sides with Hopper's fast (reduced-precision) fp8 accumulation, for the record.
    for m, (n, k), label in ((8192, (8192, 8192), "square"), (8192, LLAMA3_8B["gate_up"], "gate_up"),
                             (2048, LLAMA3_8B["down"], "down")):  # fmt: skip
        rows.append(bench_gemm(m, n, k, label, fast_accum=True))
        print(rows[-1], flush=True)
    rows += [bench_quantize(8192, 4096), bench_quantize(32, 14336)]
    report("FP8 e4m3 GEMM (per-token x per-channel scales, bf16 out)", rows, args.json)


if __name__ == "__main__":
    main()
