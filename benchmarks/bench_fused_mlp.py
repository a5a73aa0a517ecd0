"""A batch-1 MLP (gate_up + SiLU·mul, then down_proj) in one persistent launch with a grid barrier between the two
GEMMs, against the two launches the engine runs (the committed small-M table's pinned configs).

    python benchmarks/bench_fused_mlp.py [--json rows.json]

`bench_fused_floor.py` asks whether one launch with grid barriers reads a layer's bytes faster than one launch per
operation. This is the same question with the real work of the layer's two largest operations (352 MB of its 436):
P programs, all resident at once, each owns units of work that cost the same, and runs them with the engine's own
small-M loop (`gemm_small_m._row_sums`: swapped dots over a 16-row x tile, the weight tiles pipelined by cp.async).
  * gate_up + SiLU·mul: a unit is BLOCK_I intermediate columns (their gate and up rows, the whole K of 4,096), h
    rounded as the engine's launch stores it (`gemm_small_m.store_out`);
  * a barrier: every h column is written;
  * down_proj: a unit is BLOCK_N output rows over a K_SPLIT-th of the 14,336 intermediate columns; each unit stores
    its float32 partial, and the last of a row tile's units to arrive adds them in split order and writes out in x's
    dtype (the engine's split-K reduction).
With PREFETCH bytes, a program queues the first bytes of each weight row of its first down unit for L2 (bulk
prefetches, sm_90) before it waits at the barrier, so HBM keeps streaming while the last gate_up units finish. A
configuration whose programs cannot all be resident would wait forever; the polls give up after SPIN_LIMIT and flag
the launch, and it is skipped. (The engine's own fused launch, with the folded norm's epilogues, is
sits.kernels.fused_mlp; `prof1-fmlp` times it in the decode step.)

The peer, in the same run and CUDA graphs, over the same two rotated copies of the weights (704 MB, nothing read from
L2): `small_m_gemm_silu_mul` then `small_m_gemm_splitk` at the table's batch-1 configs, the engine's two launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from kernel_bench_utils import Measurement, parse_args, report, rotating, time_ms

from sits.kernels.gemm_small_m import _row_sums, small_m_gemm_silu_mul, store_out
from sits.kernels.gemm_small_m_splitk import counters_needed, small_m_gemm_splitk
from sits.kernels.grid_barrier import grid_barrier, grid_barrier_reset
from sits.kernels.l2_prefetch import _bulk_prefetch
from sits.kernels.last_arrival import last_arrival
from sits.kernels.launch_utils import is_interpreter
from sits.kernels.small_m_table import load_small_m_table

DEVICE = "cuda"
DTYPE = torch.bfloat16
HIDDEN, INTERMEDIATE = 4096, 14336
COPIES = 2
SPIN_LIMIT = 1 << 22
# (BLOCK_I, BLOCK_N, K_SPLIT, BLOCK_K, num_warps, num_stages, PREFETCH bytes a down row, programs): every program
# gets the same number of units of each phase (14,336 / BLOCK_I gate_up units, 4,096 / BLOCK_N x 7 down units), and
# all programs must fit at once: 448 programs are 4 an SM (132 SMs), 224 are 2.
CONFIGS = [(32, 64, 7, 64, 4, 4, 0, 448), (32, 64, 7, 64, 4, 4, 256, 448), (32, 64, 7, 64, 4, 4, 1024, 448),
           (64, 128, 7, 128, 8, 3, 0, 224), (64, 128, 7, 128, 8, 3, 512, 224)]


@triton.jit
def _gate_up_unit(x_ptr, w_ptr, h_ptr, unit, K, INTER, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """h[unit's BLOCK_I columns] = silu(x @ gate^T) * (x @ up^T) for one row x [K]; w: [2I, K] (gate rows, then up).
    The engine's direct kernel's own loop (`_row_sums`, swapped dots over a 16-row x tile) and epilogue."""
    offs_m = tl.arange(0, 16)
    in_m = offs_m < 1
    r = tl.arange(0, 2 * BLOCK_I)
    rows_w = (unit * BLOCK_I + r % BLOCK_I + (r // BLOCK_I) * INTER).to(tl.int64)
    sums = _row_sums(x_ptr, w_ptr, offs_m.to(tl.int64), in_m, rows_w, K, K, K, 16, 2 * BLOCK_I, BLOCK_K, True, True,
                     DOT_FP32)
    store_out(h_ptr, sums, offs_m, unit * BLOCK_I + tl.arange(0, BLOCK_I), in_m, INTER, INTER, 16, BLOCK_I, True)


@triton.jit
def _down_unit(h_ptr, w_ptr, out_ptr, ws_ptr, counters_ptr, unit, tiles, span, N, INTER, BLOCK_N: tl.constexpr,
               K_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """ws[split, rows] = w[rows, k0:k0 + span] @ h[k0:k0 + span] for the unit's BLOCK_N rows; the last of a row tile's
    K_SPLIT units to arrive adds them in split order and stores out[rows] (the engine's split-K reduction)."""
    offs_m = tl.arange(0, 16)
    in_m = offs_m < 1
    tile = unit % tiles
    rows_w = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k0 = (unit // tiles) * span
    sums = _row_sums(h_ptr + k0, w_ptr + k0, offs_m.to(tl.int64), in_m, rows_w, span, INTER, INTER, 16, BLOCK_N,
                     BLOCK_K, True, True, DOT_FP32)
    slot = offs_m[:, None] * N + rows_w[None, :]
    tl.store(ws_ptr + (unit // tiles) * N + slot, sums, mask=in_m[:, None])
    if last_arrival(counters_ptr + tile, K_SPLIT):
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(K_SPLIT):
            acc += tl.load(ws_ptr + s * N + slot, mask=in_m[:, None], other=0.0, cache_modifier=".cg")
        store_out(out_ptr, acc, offs_m, rows_w, in_m, N, N, 16, BLOCK_N, False)


@triton.jit
def _prefetch_down_unit(w_ptr, unit, tiles, span, INTER, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr):
    """Queue the first PREFETCH bytes of each of a down unit's BLOCK_N weight rows for L2 (sm_90 bulk prefetches)."""
    rows = ((unit % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    starts = w_ptr + rows * INTER + (unit // tiles) * span
    _bulk_prefetch(starts, tl.full([BLOCK_N], PREFETCH, tl.int32), False)


@triton.jit
def _fused_mlp_kernel(x_ptr, w_gate_up_ptr, w_down_ptr, h_ptr, out_ptr, ws_ptr, counters_ptr, counter, flag,
                      spin_limit, N, INTER, K,
                      BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREFETCH: tl.constexpr, DOT_FP32: tl.constexpr):
    """Grid (P,): gate_up + SiLU·mul units pid, pid + P, ...; the barrier; down units likewise. x: [K]; h: [INTER];
    out: [N] in x's dtype; ws: [K_SPLIT, N] float32; counters_ptr: [N / BLOCK_N] int32, zero (and zero again after).
    PREFETCH > 0: the bytes of each weight row of a program's first down unit queued for L2 before it waits."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for unit in range(pid, INTER // BLOCK_I, programs):
        _gate_up_unit(x_ptr, w_gate_up_ptr, h_ptr, unit, K, INTER, BLOCK_I, BLOCK_K, DOT_FP32)
    tiles = N // BLOCK_N
    span = INTER // K_SPLIT
    if PREFETCH > 0:
        _prefetch_down_unit(w_down_ptr, pid, tiles, span, INTER, PREFETCH, BLOCK_N)
    grid_barrier(counter, programs, flag, spin_limit)
    for unit in range(pid, tiles * K_SPLIT, programs):
        _down_unit(h_ptr, w_down_ptr, out_ptr, ws_ptr, counters_ptr, unit, tiles, span, N, INTER, BLOCK_N, K_SPLIT,
                   BLOCK_K, DOT_FP32)
    grid_barrier_reset(counter, 2 * programs)


def units(config: tuple[int, ...]) -> tuple[int, int]:
    """(gate_up units, down units) of a config at HIDDEN x INTERMEDIATE."""
    block_i, block_n, k_split = config[:3]
    return INTERMEDIATE // block_i, HIDDEN // block_n * k_split


@dataclass
class Buffers:
    """What a fused launch writes besides its weights: h [INTER] and out [N] in x's dtype; ws [8, N] float32 (the
    down units' partials); tiles [N / 16] int32 (a counter per down row tile); counter, flag [1] int32 (the
    barrier's count and its gave-up flag). The counters are zero before a launch and after it."""

    h: torch.Tensor
    out: torch.Tensor
    ws: torch.Tensor
    tiles: torch.Tensor
    counter: torch.Tensor
    flag: torch.Tensor

    @classmethod
    def new(cls, hidden: int, inter: int, dtype: torch.dtype, device: str) -> Buffers:
        ints = {"dtype": torch.int32, "device": device}
        return cls(torch.zeros(inter, dtype=dtype, device=device), torch.zeros(hidden, dtype=dtype, device=device),
                   torch.zeros(8 * hidden, dtype=torch.float32, device=device), torch.zeros(hidden // 16, **ints),
                   torch.zeros(1, **ints), torch.zeros(1, **ints))


def fused_mlp(x, w_gate_up, w_down, bufs: Buffers, config, programs: int | None = None,
              spin_limit: int | None = None) -> torch.Tensor:
    """bufs.out = down(silu(gate(x)) * up(x)) for x [K] in one launch of `programs` (default: the config's)."""
    block_i, block_n, k_split, block_k, warps, stages, prefetch, default_programs = config
    n, i = w_down.shape
    grid = programs or default_programs
    assert grid <= units(config)[1], "a program's first down unit is its id: at most one program a down unit"
    assert k_split <= 8 and block_n >= 16, "bufs.ws holds 8 splits, bufs.tiles a counter per 16 rows"
    limit = SPIN_LIMIT if spin_limit is None else spin_limit
    _fused_mlp_kernel[(grid,)](x, w_gate_up, w_down, bufs.h, bufs.out, bufs.ws, bufs.tiles, bufs.counter, bufs.flag,
                               limit, n, i, x.numel(), BLOCK_I=block_i, BLOCK_N=block_n, K_SPLIT=k_split,
                               BLOCK_K=block_k, PREFETCH=0 if is_interpreter() else prefetch, DOT_FP32=False,
                               num_warps=warps, num_stages=stages)
    return bufs.out


def reference(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The same MLP in float32 from the h the kernel stores (rounded as the engine's launch rounds it: gate and up
    to x's dtype, silu(gate) to it, their product to it): [N] float32."""
    gate, up = (w_gate_up.float() @ x.float()).to(x.dtype).float().chunk(2)
    h = ((gate * torch.sigmoid(gate)).to(x.dtype).float() * up).to(x.dtype)
    return w_down.float() @ h.float()


def engine_mlp(x2d, w_gate_up, w_down, counters, configs) -> torch.Tensor:
    """The engine's two launches at the table's batch-1 configs: [1, N] bf16."""
    h = small_m_gemm_silu_mul(x2d, w_gate_up, config=configs[0])
    return small_m_gemm_splitk(h, w_down, counters, config=configs[1])


def table_configs() -> tuple[dict, dict]:
    """The committed table's batch-1 configs of gate_up + SiLU·mul and of down_proj (measured on an H200)."""
    table = load_small_m_table()
    return (table.pinned_configs("silu_mul", 2 * INTERMEDIATE, HIDDEN)[1],
            table.pinned_configs("linear", HIDDEN, INTERMEDIATE)[1])


def main() -> None:
    args = parse_args(__doc__)
    weights = [(torch.randn(2 * INTERMEDIATE, HIDDEN, dtype=DTYPE, device=DEVICE) * 0.02,
                torch.randn(HIDDEN, INTERMEDIATE, dtype=DTYPE, device=DEVICE) * 0.02) for _ in range(COPIES)]
    x = torch.randn(HIDDEN, dtype=DTYPE, device=DEVICE)
    bufs = Buffers.new(HIDDEN, INTERMEDIATE, DTYPE, DEVICE)
    counters = torch.zeros(counters_needed(HIDDEN), dtype=torch.int32, device=DEVICE)
    configs = table_configs()
    expected = reference(x, *weights[0])
    scale = float(expected.abs().max())
    peer = engine_mlp(x[None], *weights[0], counters, configs)[0].float()
    peer_us = time_ms(rotating(lambda i: engine_mlp(x[None], *weights[i], counters, configs), COPIES)) * 1e3
    rows, notes = [], [f"the engine's two launches {peer_us:.2f} us (max |err| {float((peer - expected).abs().max()) / scale:.1e})"]
    print(notes[0], flush=True)
    for config in CONFIGS:
        bufs.flag.zero_()
        got = fused_mlp(x, *weights[0], bufs, config).float()
        if int(bufs.flag.item()):
            bufs.counter.zero_()
            print(f"fused {config}: not every program resident (the barrier gave up); skipped", flush=True)
            continue
        err = float((got - expected).abs().max()) / scale
        us = time_ms(rotating(lambda i, c=config: fused_mlp(x, *weights[i], bufs, c), COPIES)) * 1e3
        if int(bufs.flag.item()):
            raise RuntimeError(f"fused {config}: the barrier gave up inside the timed graph")
        note = f"fused {config} units {units(config)}: {us:.2f} us, the engine's / this {peer_us / us:.3f}x (max |err| {err:.1e})"
        print(note, flush=True)
        notes.append(note)
        assert err < 2e-2, note
        rows.append(Measurement(f"MLP at batch 1, fused {config}", "us", us, peer_us, "two launches", us / 1e3,
                                peer_us / 1e3, {"units": list(units(config))}))
    report("Batch-1 MLP in one launch with a grid barrier against the engine's two launches (Llama-3-8B)", rows,
           args.json, notes)


if __name__ == "__main__":
    main()
