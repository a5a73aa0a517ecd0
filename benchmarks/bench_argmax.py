"""Greedy decoding's argmax on the GPU: SITS's two-launch kernel against torch.argmax.

    python benchmarks/bench_argmax.py [--json out.json] [--quick]

Rows of float32 logits ([batch, vocab]: Llama-3's 128,256 and SmolLM2's 49,152), as the sampler
receives them from the LM head: the figure is the logits read per second (GB/s) and its share of
the copy bandwidth measured in the same run; the peer is torch.argmax(logits, dim=-1). The logits
are not rotated out of L2, since in a decode step the LM head has just written them. Each case also
checks that both give the same indices.
"""

from __future__ import annotations

import torch
from kernel_bench_utils import Measurement, bandwidth_case, bandwidth_main

from sits.kernels.argmax import argmax_rows


def bench_case(rows: int, vocab: int, copy_gbps: float) -> list[Measurement]:
    logits = torch.randn(rows, vocab, dtype=torch.float32, device="cuda")
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    if not torch.equal(argmax_rows(logits, out=out), logits.argmax(dim=-1)):
        raise SystemExit(f"argmax_rows differs from torch.argmax at {rows} x {vocab}")
    num_bytes = logits.numel() * logits.element_size()
    peers = {"torch.argmax": lambda: logits.argmax(dim=-1)}
    return [bandwidth_case(f"{rows}x{vocab}", num_bytes, lambda: argmax_rows(logits, out=out), peers, copy_gbps)]


def main():
    shapes = [(1, 128256), (4, 128256), (32, 128256), (256, 128256), (512, 128256), (1, 49152), (32, 49152)]
    bandwidth_main(__doc__, "Vocabulary argmax, float32 logits", shapes, bench_case)


if __name__ == "__main__":
    main()
