"""SiLU·mul on the GPU: SITS's kernel against eager PyTorch (F.silu(gate) * up).

    python benchmarks/bench_silu_mul.py [--json out.json]

The figure is bandwidth: gate_up read once ([M, 2F]) plus out written ([M, F]) over the time,
and its share of the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_bench_utils import Measurement, bandwidth_case, bandwidth_main

from sits.kernels.silu_mul import silu_mul


def bench_case(rows, ffn, copy_gbps) -> Measurement:
    gate_up = torch.randn(rows, 2 * ffn, dtype=torch.bfloat16, device="cuda")
    num_bytes = 3 * rows * ffn * gate_up.element_size()

    def eager():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    return bandwidth_case(f"{rows}x{ffn}", num_bytes, lambda: silu_mul(gate_up), {"eager silu*mul": eager}, copy_gbps)


def main():
    bandwidth_main(__doc__, "SiLU·mul, bf16", [(8192, 14336), (2048, 14336), (32, 14336), (16384, 1536)],
                   lambda r, f, copy_gbps: [bench_case(r, f, copy_gbps)])


if __name__ == "__main__":
    main()
