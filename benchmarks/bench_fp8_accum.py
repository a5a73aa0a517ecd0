"""Precise or fast fp8 accumulation per GEMM shape: both modes' error and speed, and the table they give.

    python benchmarks/bench_fp8_accum.py [--json rows.json] [--table fp8_accum_table.json] [--quick]

For each Llama-3-8B projection (qkv, o, gate_up, down) at M = 32 (a decode batch: the split-K
kernel), 256 (a throughput-mode decode batch: the TMA kernel) and 4,096 (prefill), SITS's fp8_gemm runs with precise
accumulation (float32 promotion every 128 of K) and with fast accumulation; torch._scaled_mm runs
both ways on the same operands as the peer. Error: the relative Frobenius error of a float32 output
against float32 sums of the same e4m3 operands (the accumulation's own error; random normal
activations and weights of std 0.02). The rule of sits.kernels.fp8_accum (`choose_fast`) picks the
mode per shape; `--table` writes the table the engine loads (copy it to kernels/fp8_accum_table.json
to use it; it applies on a GPU of the same name only). Prints a markdown table (precise against
torch._scaled_mm) and one RESULT line.
"""

from __future__ import annotations

import argparse
import math

import torch
from kernel_bench_utils import Measurement, report, time_ms

from sits.kernels.fp8_accum import AccumEntry, AccumTable, choose_fast, m_bucket
from sits.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference, quantize_weight_fp8_per_channel
from sits.kernels.fp8_quantize import quantize_fp8_per_token

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
M_VALUES = (32, 256, 4096)  # M buckets between them take the entry below (fp8_accum)


def _error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out - expected).norm() / expected.norm()).item()


def measure(m: int, n: int, k: int, label: str) -> tuple[Measurement, AccumEntry]:
    """Both modes of one shape: (the table row against torch._scaled_mm, the accumulation entry)."""
    torch.manual_seed(m + n + k)
    a, sa = quantize_fp8_per_token(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"))
    w, sw = quantize_weight_fp8_per_channel(torch.randn(n, k, device="cuda") * 0.02)
    sw_row = sw.reshape(1, -1).contiguous()
    expected = fp8_gemm_reference(a, sa, w, sw, out_dtype=torch.float32)
    errors = {fast: _error(fp8_gemm(a, sa, w, sw, out_dtype=torch.float32, fast_accum=fast), expected)
              for fast in (False, True)}
    ours = {fast: time_ms(lambda fast=fast: fp8_gemm(a, sa, w, sw, fast_accum=fast)) for fast in (False, True)}
    peer = {fast: time_ms(lambda fast=fast: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw_row,
                                                             out_dtype=torch.bfloat16, use_fast_accum=fast))
            for fast in (False, True)}
    fast = choose_fast(errors[False], errors[True], ours[False], ours[True])
    entry = AccumEntry(m_bucket(m), n, k, fast, errors[False], errors[True], ours[False], ours[True], peer[False])
    tflops = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e12  # noqa: E731
    chosen_ms = ours[fast]
    extra = {"chosen": "fast" if fast else "precise", "precise_error": errors[False], "fast_error": errors[True],
             "precise_ms": ours[False], "fast_ms": ours[True], "scaled_mm_fast_ms": peer[True],
             "fast_vs_scaled_mm_fast": peer[True] / ours[True]}
    row = Measurement(f"{label} M{m} N{n} K{k} ({extra['chosen']})", "TFLOP/s", tflops(chosen_ms),
                      tflops(peer[False]), "torch._scaled_mm", chosen_ms, peer[False], extra)
    return row, entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="also write the measurements to this JSON file")
    parser.add_argument("--table", help="write the accumulation table (sits.kernels.fp8_accum) here")
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    args = parser.parse_args()
    cases = [(m, name) for name in LLAMA3_8B for m in M_VALUES]
    rows, entries = [], {}
    for m, name in cases[:2] if args.quick else cases:
        row, entry = measure(m, *LLAMA3_8B[name], name)
        rows.append(row)
        entries[(entry.m_bucket, entry.n, entry.k)] = entry
        print(row, flush=True)
    table = AccumTable(torch.cuda.get_device_name(), entries)
    if args.table:
        with open(args.table, "w") as f:
            f.write(table.to_json())
    report("FP8 GEMM accumulation per shape: the chosen mode against torch._scaled_mm (precise)", rows, args.json,
           ["Errors: relative, float32 output against float32 sums of the same e4m3 operands."])
    fast = [r.case.split(" (")[0] for r in rows if r.extra["chosen"] == "fast"]
    worst = max(r.extra["fast_error"] for r in rows)
    geo = math.exp(sum(math.log(r.ratio) for r in rows) / len(rows))
    print(f"RESULT fp8-modes: fast accumulation chosen for {len(fast)} of {len(rows)} shapes "
          f"({', '.join(fast) or 'none'}); largest fast-mode error {worst:.2e}; chosen mode vs torch._scaled_mm "
          f"(precise), geometric mean {geo:.2f}x")


if __name__ == "__main__":
    main()
