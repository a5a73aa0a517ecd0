"""The fp8 MLP's activation step on the GPU: SiLU·mul with the e4m3 quantization fused into its epilogue,
against the two kernels it replaces (silu_mul, then quantize_fp8_per_token) and against eager PyTorch.

    python benchmarks/bench_silu_mul_quant.py [--json out.json] [--quick]

The figure is bandwidth over the fused step's own traffic: gate_up read once ([M, 2F] bf16), the
e4m3 product written ([M, F], one byte each) and one float32 scale per row. The unfused pair moves
more (the bf16 product is written, then read back), so the ratio is the fused step's speed-up.
Llama-3-8B's F = 14,336 at a decode batch (32), a throughput-mode decode batch (512) and a prefill
step (8,192). Prints the table and one RESULT line.
"""

from __future__ import annotations

import torch
from kernel_bench_utils import Measurement, bandwidth_case, bandwidth_main

from sits.kernels.fp8_quantize import quantize_fp8_per_token
from sits.kernels.reference import silu_mul_quant_fp8_reference
from sits.kernels.silu_mul import silu_mul, silu_mul_quant_fp8

SHAPES = [(32, 14336), (512, 14336), (8192, 14336)]


def bench_case(tokens: int, ffn: int, copy_gbps: float) -> Measurement:
    """One shape: fused against the unfused kernels and eager PyTorch, GB/s of the fused traffic."""
    gate_up = torch.randn(tokens, 2 * ffn, dtype=torch.bfloat16, device="cuda") * 3
    moved = tokens * (2 * ffn * gate_up.element_size() + ffn + 4)
    peers = {"silu_mul + quantize_fp8_per_token (unfused kernels)": lambda: quantize_fp8_per_token(silu_mul(gate_up)),
             "eager PyTorch": lambda: silu_mul_quant_fp8_reference(gate_up)}
    return bandwidth_case(f"{tokens}x{ffn}", moved, lambda: silu_mul_quant_fp8(gate_up), peers, copy_gbps)


def main() -> None:
    rows: list[Measurement] = []

    def run_shape(tokens: int, ffn: int, copy_gbps: float) -> list[Measurement]:
        rows.append(bench_case(tokens, ffn, copy_gbps))
        return rows[-1:]

    bandwidth_main(__doc__, "SiLU·mul with fused e4m3 quantization, bf16 in", SHAPES, run_shape)
    print("RESULT fp8-act: fused SiLU·mul + e4m3 quantization vs the best unfused peer: "
          + ", ".join(f"{r.case} {r.ratio:.2f}x ({r.extra['pct_of_copy_bw']}% of copy bandwidth)" for r in rows))


if __name__ == "__main__":
    main()
