"""SiLU·mul on the GPU: SITS's kernel against eager PyTorch (F.silu(gate) * up).

    python benchmarks/bench_silu_mul.py [--json out.json]

The figure is bandwidth: gate_up read once ([M, 2F]) plus out written ([M, F]) over the time,
and its share of the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_bench_utils import Measurement, best_peer, hbm_copy_gbps, parse_args, report, time_ms

from sits.kernels.silu_mul import silu_mul


def bench_case(rows, ffn, copy_gbps) -> Measurement:
    gate_up = torch.randn(rows, 2 * ffn, dtype=torch.bfloat16, device="cuda")
    num_bytes = 3 * rows * ffn * gate_up.element_size()

    def eager():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    peer_name, peer_ms, _ = best_peer({"eager silu*mul": eager}, num_bytes)
    ours_ms = time_ms(lambda: silu_mul(gate_up))
    gbps = lambda ms: num_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    return Measurement(
        f"{rows}x{ffn}", "GB/s", gbps(ours_ms), gbps(peer_ms), peer_name, ours_ms, peer_ms,
        {"pct_of_copy_bw": round(100 * gbps(ours_ms) / copy_gbps, 1)},
    )  # fmt: skip


def main():
    args = parse_args(__doc__)
    copy_gbps = hbm_copy_gbps()
    cases = [(8192, 14336), (2048, 14336), (32, 14336), (16384, 1536)]
    if args.quick:
        cases = cases[:1]
    rows = [bench_case(r, f, copy_gbps) for r, f in cases]
    notes = [f"HBM copy bandwidth in this run: {copy_gbps:,.0f} GB/s; SITS share of it per case: "
             + ", ".join(f"{r.case}: {r.extra['pct_of_copy_bw']}%" for r in rows)]  # fmt: skip
    report("SiLU·mul, bf16", rows, args.json, notes)


if __name__ == "__main__":
    main()
