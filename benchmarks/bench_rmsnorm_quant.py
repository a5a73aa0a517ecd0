"""The fp8 w8a8 decoder norm on the GPU: add + RMSNorm with the e4m3 per-token quantization in its epilogue,
against the two kernels it replaces in the same run (the project's rms_norm, then quantize_fp8_per_token).

    python benchmarks/bench_rmsnorm_quant.py [--json out.json] [--quick]

Each case is a middle layer's norm: x [rows, 4096] bf16 (the previous sublayer's output) added into the
float32 residual stream in place, normalized, and quantized for the next projection. Rows 1 and 32 (decode
batches), 448 (a throughput-mode decode batch) and 8,192 (a prefill step). Both sides are timed inside a CUDA
graph (kernel_bench_utils.time_ms: 10 calls per graph, the median of 15 replays), rotating through enough
input copies that no call reads its inputs from L2. The figure is GB/s over the fused step's own traffic
(x read, the stream read and written, the e4m3 row and its scale written: 11 bytes a column and 4 a row);
the unfused pair also writes the bf16 normed row and reads it back, so the ratio is the fused step's
speed-up. Before timing, each case checks that both sides give the same e4m3 bytes, scales and stream
(bit for bit: a difference is counted and printed, never hidden). Prints the table and one RESULT line.
"""

from __future__ import annotations

import argparse
import json

import torch
from kernel_bench_utils import rotating, time_ms

from sits.kernels.fp8_quantize import quantize_fp8_per_token
from sits.kernels.rmsnorm import rms_norm
from sits.kernels.rmsnorm_quant import rms_norm_quant_fp8

DEVICE = "cuda"
DTYPE = torch.bfloat16  # the model dtype (x, the weight, the normed row)
HIDDEN = 4096
ROWS = [1, 32, 448, 8192]
L2_DEFEAT_BYTES = 256 << 20
EPS = 1e-5


def _inputs(rows: int, hidden: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`copies` (x [rows, hidden] DTYPE, stream [rows, hidden] float32) pairs."""
    return [(torch.randn(rows, hidden, device=DEVICE).mul(2).to(DTYPE),
             torch.randn(rows, hidden, device=DEVICE).mul(8)) for _ in range(copies)]  # fmt: skip


def fused(x: torch.Tensor, stream: torch.Tensor, weight: torch.Tensor):
    """The fused step: (e4m3 [rows, hidden], scale [rows, 1]); the stream updated in place."""
    out, scale, _ = rms_norm_quant_fp8(x, weight, EPS, residual=stream, residual_out=stream)
    return out, scale


def unfused(x: torch.Tensor, stream: torch.Tensor, weight: torch.Tensor):
    """What the layer ran before: the project's add + rms_norm (stream in place), then quantize_fp8_per_token."""
    normed, _ = rms_norm(x, weight, EPS, residual=stream, out=torch.empty_like(x), residual_out=stream)
    return quantize_fp8_per_token(normed)


def check(rows: int, hidden: int, weight: torch.Tensor) -> dict:
    """Both sides on the same inputs: how many e4m3 bytes, scales and stream values differ (0 = identical)."""
    ((x, stream),) = _inputs(rows, hidden, 1)
    stream_peer = stream.clone()
    got, got_scale = fused(x, stream, weight)
    expected, expected_scale = unfused(x, stream_peer, weight)
    return {"fp8_differ": int((got.view(torch.uint8) != expected.view(torch.uint8)).sum()),
            "scale_differ": int((got_scale != expected_scale).sum()),
            "stream_differ": int((stream != stream_peer).sum())}  # fmt: skip


def bench_case(rows: int, hidden: int) -> dict:
    """One shape: both sides timed; microseconds, GB/s of the fused traffic, the ratio and the check."""
    weight = (torch.randn(hidden, device=DEVICE) * 0.1 + 1).to(DTYPE)
    row: dict = {"rows": rows, "hidden": hidden, **check(rows, hidden, weight)}
    copies = max(2, min(8, L2_DEFEAT_BYTES // (rows * hidden * 10)))
    sets = _inputs(rows, hidden, copies)
    moved = rows * (11 * hidden + 4)
    for side, call in (("fused", fused), ("unfused", unfused)):
        us = time_ms(rotating(lambda i, call=call: call(*sets[i], weight), copies)) * 1e3
        row[f"{side}_us"] = us
        row[f"{side}_gbps"] = moved / (us * 1e-6) / 1e9
    row["ratio"] = row["unfused_us"] / row["fused_us"]
    row["input_copies"] = copies
    return row


def _fmt(row: dict) -> str:
    identical = "identical" if not (row["fp8_differ"] or row["scale_differ"] or row["stream_differ"]) else (
        f"DIFFER: {row['fp8_differ']} e4m3 bytes, {row['scale_differ']} scales, {row['stream_differ']} stream values")
    return (f"{row['rows']:5d} x {row['hidden']} | fused {row['fused_us']:8.2f} us {row['fused_gbps']:7.1f} GB/s | "
            f"rms_norm + quantize_fp8_per_token {row['unfused_us']:8.2f} us {row['unfused_gbps']:7.1f} GB/s | "
            f"{row['ratio']:.2f}x | {identical}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for count in ROWS[:1] if args.quick else ROWS:
        rows.append(bench_case(count, HIDDEN))
        print(_fmt(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    print("RESULT fp8-norm-quant: fused add + RMSNorm + e4m3 quantization vs rms_norm then quantize_fp8_per_token: "
          + ", ".join(f"{r['rows']}x{r['hidden']} {r['ratio']:.2f}x" for r in rows))


if __name__ == "__main__":
    main()
