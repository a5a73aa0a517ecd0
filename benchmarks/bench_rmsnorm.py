"""RMSNorm on the GPU: SITS's kernel (with and without the fused residual add) against eager PyTorch.

    python benchmarks/bench_rmsnorm.py [--json out.json]

The figure is bandwidth: bytes read + written (x, weight, out; plus residual in and out when
fused) over the time, and its share of the device-to-device copy bandwidth measured in the same run.
Peers: HF Llama's eager formula and torch.nn.functional.rms_norm; for the fused case, the eager
add followed by each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_bench_utils import Measurement, best_peer, hbm_copy_gbps, parse_args, report, time_ms

from sits.kernels.rmsnorm import rms_norm, rms_norm_reference

EPS = 1e-5


def bench_case(rows, hidden, fused, copy_gbps) -> Measurement:
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
    tensors = 4 if fused else 2
    num_bytes = tensors * x.numel() * x.element_size() + weight.numel() * weight.element_size()
    if fused:
        peers = {
            "eager HF add+norm": lambda: rms_norm_reference(x, weight, EPS, residual=residual),
            "eager add + F.rms_norm": lambda: (F.rms_norm(x + residual, (hidden,), weight, EPS)),
        }
        ours = lambda: rms_norm(x, weight, EPS, residual=residual)  # noqa: E731
    else:
        peers = {
            "eager HF": lambda: rms_norm_reference(x, weight, EPS),
            "F.rms_norm": lambda: F.rms_norm(x, (hidden,), weight, EPS),
        }
        ours = lambda: rms_norm(x, weight, EPS)  # noqa: E731
    peer_name, peer_ms, _ = best_peer(peers, num_bytes)
    ours_ms = time_ms(ours)
    gbps = lambda ms: num_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    case = f"{rows}x{hidden}{' +residual' if fused else ''}"
    return Measurement(
        case, "GB/s", gbps(ours_ms), gbps(peer_ms), peer_name, ours_ms, peer_ms,
        {"pct_of_copy_bw": round(100 * gbps(ours_ms) / copy_gbps, 1)},
    )  # fmt: skip


def main():
    args = parse_args(__doc__)
    copy_gbps = hbm_copy_gbps()
    cases = [(8192, 4096), (32768, 4096), (16384, 8192), (256, 4096)]
    if args.quick:
        cases = cases[:1]
    rows = [bench_case(r, h, fused, copy_gbps) for r, h in cases for fused in (False, True)]
    notes = [f"HBM copy bandwidth in this run: {copy_gbps:,.0f} GB/s; SITS share of it per case: "
             + ", ".join(f"{r.case}: {r.extra['pct_of_copy_bw']}%" for r in rows)]  # fmt: skip
    report("RMSNorm, bf16", rows, args.json, notes)


if __name__ == "__main__":
    main()
