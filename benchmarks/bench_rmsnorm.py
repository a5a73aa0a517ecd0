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
from kernel_bench_utils import Measurement, bandwidth_case, bandwidth_main

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
    return bandwidth_case(f"{rows}x{hidden}{' +residual' if fused else ''}", num_bytes, ours, peers, copy_gbps)


def main():
    bandwidth_main(__doc__, "RMSNorm, bf16", [(8192, 4096), (32768, 4096), (16384, 8192), (256, 4096)],
                   lambda r, h, copy_gbps: [bench_case(r, h, fused, copy_gbps) for fused in (False, True)])


if __name__ == "__main__":
    main()
