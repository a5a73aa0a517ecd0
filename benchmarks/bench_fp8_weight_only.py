"""FP8 weight-only GEMM on the GPU at decode sizes: SITS's W8A16 kernel against bf16 cuBLAS, same run.

    python benchmarks/bench_fp8_weight_only.py [--json out.json] [--quick]

x [M, K] bf16, w_fp8 [N, K] e4m3 with per-output-channel float32 scales, dequantized in the
kernel's load (the `--fp8-mode weight-only` path: GPUs without fp8 tensor cores). The peer is
`F.linear(x, w_bf16)` on the unquantized weight (cuBLAS; what the model runs without
quantization, reading twice the weight bytes). M in {1, 8, 16, 32} over Llama-3-8B's projections;
both sides rotate through weight copies so neither is timed out of L2. Both decodings run: native
(the e4m3 conversion of SM 8.9+, what the H200 uses) and bits (integer decoding, the A100's only
path, measured here on the same GPU, at M = 1 and 32). Prints the table and one RESULT line: the geometric-mean ratio
per M over the four projections, per decoding (> 1: faster than bf16).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from kernel_bench_utils import Measurement, best_peer, parse_args, report, rotating, time_ms

from sits.kernels.fp8_weight_only_gemm import DECODES, fp8_weight_only_gemm, fp8_weight_only_gemm_reference
from sits.kernels.quantization import quantize_weight_fp8_per_channel

L2_DEFEAT_BYTES = 256 << 20
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
M_VALUES = (1, 8, 16, 32)
BITS_M_VALUES = (1, 32)  # the A100's decoding: its ends of the range (GPU time is scarce)


def _operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """(x bf16 [m, k], w bf16 [n, k], w_fp8 [n, k], w_scale [n, 1]): one copy of a case's inputs."""
    w = torch.randn(n, k, device="cuda").mul_(0.02)
    return (torch.randn(m, k, dtype=torch.bfloat16, device="cuda"), w.to(torch.bfloat16),
            *quantize_weight_fp8_per_channel(w))


def bench_case(m: int, n: int, k: int, label: str, decode: str) -> Measurement:
    """One shape: weight-only fp8 (one decoding) against bf16 F.linear."""
    copies = max(1, min(8, L2_DEFEAT_BYTES // (2 * n * k)))
    sets = [_operands(m, n, k) for _ in range(copies)]
    peer_name, peer_ms, _ = best_peer({"bf16 F.linear (cuBLAS)": rotating(lambda i: F.linear(sets[i][0], sets[i][1]),
                                                                         copies)}, 2 * m * n * k)
    ours_ms = time_ms(rotating(lambda i: fp8_weight_only_gemm(sets[i][0], sets[i][2], sets[i][3], decode), copies))
    x, _, w_fp8, w_scale = sets[0]
    expected = fp8_weight_only_gemm_reference(x, w_fp8, w_scale).float()
    error = ((fp8_weight_only_gemm(x, w_fp8, w_scale, decode).float() - expected).norm() / expected.norm()).item()
    tflops = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e12  # noqa: E731
    extra = {"fp8_weight_GBps": round(n * k / (ours_ms * 1e-3) / 1e9), "bf16_weight_GBps":
             round(2 * n * k / (peer_ms * 1e-3) / 1e9), "rel_err_vs_reference": error}
    return Measurement(f"{label} {decode} M{m} N{n} K{k}", "TFLOP/s", tflops(ours_ms), tflops(peer_ms), peer_name, ours_ms,
                       peer_ms, extra)


def main() -> None:
    args = parse_args(__doc__)
    rows: list[Measurement] = []
    m_values = M_VALUES[:1] if args.quick else M_VALUES
    per_decode = {"native": m_values, "bits": BITS_M_VALUES[:1] if args.quick else BITS_M_VALUES}
    for decode in DECODES:
        for m in per_decode[decode]:
            for name, (n, k) in LLAMA3_8B.items():
                rows.append(bench_case(m, n, k, name, decode))
                print(rows[-1], flush=True)
    report("FP8 weight-only GEMM (e4m3 weights, per-channel scales, bf16 activations) vs bf16 cuBLAS", rows,
           args.json)
    ratios = []
    for decode in DECODES:
        for m in per_decode[decode]:
            mine = [r.ratio for r in rows if f" {decode} M{m} " in r.case]
            ratios.append(f"{decode} M={m} {math.exp(sum(map(math.log, mine)) / len(mine)):.2f}x")
    print(f"RESULT fp8-wo-gemm: weight-only fp8 vs bf16 cuBLAS, geometric mean over qkv/o/gate_up/down: "
          f"{', '.join(ratios)} (> 1: faster)")


if __name__ == "__main__":
    main()
