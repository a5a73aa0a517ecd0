"""A folded decode layer's MLP at batch 1 as the engine's one persistent launch (sits.kernels.fused_mlp, what
SITS_FUSED_MLP=1 runs) against the engine's two launches, Llama-3-8B shapes.

    python benchmarks/bench_fused_mlp.py [--json rows.json]

`bench_fused_floor.py` asks whether one launch with grid barriers reads a layer's bytes faster than one launch per
operation. This is the same question with the real work of the layer's two largest operations (352 MB of its 436),
through the engine's own kernels with the folded norm's epilogues (the rows scaled by 1 / rms from o_proj's sums of
squares, the down projection added to the float32 residual stream):
  * the peer: `small_m_gemm_silu_mul(x, w_gate_up, sumsq=, eps=)` then down_proj into the stream (the split-K kernel
    where the committed small-M table runs it at batch 1, else the direct one), at the table's batch-1 configs;
  * `fused_decode_mlp` at each of CONFIGS: gate_up + SiLU·mul units, a grid barrier, down units whose last arrival
    per column tile adds the slices in order and feeds the stream. A config with PREFETCH queues that many bytes of
    each weight row of a program's first down unit for L2 before the barrier's wait. A config whose grid cannot be
    resident at once (`fits_at_once`) is skipped.

Both run in CUDA graphs over the same two rotated copies of the weights (704 MB, nothing read from L2), each from the
same stream; every output is checked against the float32 reference before it is timed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernel_bench_utils import Measurement, parse_args, report, rotating, time_ms

from sits.kernels.fused_mlp import DEFAULT_CONFIG, FusedMlpWork, fits_at_once, fused_decode_mlp
from sits.kernels.gemm_small_m import small_m_gemm_silu_mul, small_m_gemm_to_stream, sumsq_slots
from sits.kernels.gemm_small_m_splitk import counters_needed, small_m_gemm_splitk_to_stream
from sits.kernels.reference import small_m_gemm_silu_mul_rstd_reference, small_m_gemm_to_stream_reference
from sits.kernels.small_m_table import load_small_m_table

DEVICE = "cuda"
DTYPE = torch.bfloat16
HIDDEN, INTERMEDIATE = 4096, 14336
EPS = 1e-5
COPIES = 2
WIDE = {"BLOCK_I": 64, "BLOCK_N": 128, "K_SPLIT": 7, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
# The engine's default (448 programs, 4 an SM on 132 SMs) and a wider one (224, 2 an SM), each with and without the
# L2 prefetch before the barrier.
CONFIGS = [DEFAULT_CONFIG, {**DEFAULT_CONFIG, "PREFETCH": 256}, {**DEFAULT_CONFIG, "PREFETCH": 1024}, WIDE,
           {**WIDE, "PREFETCH": 512}]


@dataclass
class Operands:
    """One decode row: x [1, K] (the rounded stream), sumsq [1, cdiv(K, 32)] float32 (its sums of squares), stream
    [1, N] float32 (updated in place by every call); COPIES copies of (w_gate_up [2I, K], w_down [N, I])."""

    x: torch.Tensor
    sumsq: torch.Tensor
    stream: torch.Tensor
    weights: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def new(cls) -> Operands:
        stream = torch.randn(1, HIDDEN, device=DEVICE)
        sumsq = (stream * stream).view(1, sumsq_slots(HIDDEN), -1).sum(-1)  # HIDDEN: whole 32-column slots
        weights = [(torch.randn(2 * INTERMEDIATE, HIDDEN, device=DEVICE).mul(HIDDEN**-0.5).to(DTYPE),
                    torch.randn(HIDDEN, INTERMEDIATE, device=DEVICE).mul(INTERMEDIATE**-0.5).to(DTYPE))
                   for _ in range(COPIES)]
        return cls(stream.to(DTYPE), sumsq, stream, weights)


@dataclass
class EngineLaunches:
    """The engine's two launches at batch 1: the table's configs, whether down_proj runs split-K, its counters."""

    silu_config: dict | None
    down_config: dict | None
    splitk: bool
    counters: torch.Tensor

    def __call__(self, ops: Operands, copy: int) -> torch.Tensor:
        """The new stream rounded to x's dtype [1, N]; ops.stream updated in place."""
        w_gate_up, w_down = ops.weights[copy]
        h = small_m_gemm_silu_mul(ops.x, w_gate_up, config=self.silu_config, sumsq=ops.sumsq, eps=EPS)
        if self.splitk:
            return small_m_gemm_splitk_to_stream(h, w_down, self.counters, ops.stream, config=self.down_config)[0]
        return small_m_gemm_to_stream(h, w_down, ops.stream, config=self.down_config)[0]


def engine_launches() -> EngineLaunches:
    """The committed table's batch-1 configs of gate_up + SiLU·mul and down_proj (measured on an H200)."""
    table = load_small_m_table()
    return EngineLaunches(table.pinned_configs("silu_mul", 2 * INTERMEDIATE, HIDDEN).get(1),
                          table.pinned_configs("linear", HIDDEN, INTERMEDIATE).get(1),
                          1 in table.splitk_buckets(HIDDEN, INTERMEDIATE),
                          torch.zeros(counters_needed(HIDDEN), dtype=torch.int32, device=DEVICE))


def fused(ops: Operands, copy: int, work: FusedMlpWork, config: dict) -> torch.Tensor:
    """The engine's one launch: the new stream rounded to x's dtype [1, N]; ops.stream updated in place."""
    return fused_decode_mlp(ops.x, ops.sumsq, EPS, *ops.weights[copy], ops.stream, work, config)[0]


def relative_error(ops: Operands, run) -> float:
    """max |run's output - the float32 reference| / max |reference|, both from the same stream (restored after)."""
    before = ops.stream.clone()
    h = small_m_gemm_silu_mul_rstd_reference(ops.x, ops.weights[0][0], ops.sumsq, EPS)
    expected = small_m_gemm_to_stream_reference(h, ops.weights[0][1], before.clone())[0].float()
    got = run(ops, 0).float()
    ops.stream.copy_(before)
    return float((got - expected).abs().max()) / float(expected.abs().max())


def main() -> None:
    args = parse_args(__doc__)
    ops = Operands.new()
    work = FusedMlpWork.new(HIDDEN, INTERMEDIATE, DTYPE, DEVICE)
    peer = engine_launches()
    peer_err = relative_error(ops, peer)
    peer_us = time_ms(rotating(lambda i: peer(ops, i), COPIES)) * 1e3
    rows, notes = [], [f"the engine's two launches {peer_us:.2f} us (split-K down: {peer.splitk}; max |err| "
                       f"{peer_err:.1e})"]
    print(notes[0], flush=True)
    for config in CONFIGS:
        if not fits_at_once(ops.x, ops.sumsq, EPS, *ops.weights[0], ops.stream, work, config):
            print(f"fused {config}: its grid is not resident at once; skipped", flush=True)
            continue
        err = relative_error(ops, lambda o, i, c=config: fused(o, i, work, c))
        us = time_ms(rotating(lambda i, c=config: fused(ops, i, work, c), COPIES)) * 1e3
        if work.gave_up():
            raise RuntimeError(f"fused {config}: the barrier gave up inside the timed graph")
        note = f"fused {config}: {us:.2f} us, the engine's two / this {peer_us / us:.3f}x (max |err| {err:.1e})"
        print(note, flush=True)
        notes.append(note)
        assert err < 2e-2, note
        rows.append(Measurement(f"MLP at batch 1, one launch {config}", "us", us, peer_us, "two launches", us / 1e3,
                                peer_us / 1e3, {"config": config}))
    report("A folded decode MLP at batch 1 in one launch against the engine's two (Llama-3-8B)", rows, args.json,
           notes)


if __name__ == "__main__":
    main()
