"""A decode step's MLP with its folded norm in one persistent launch (small batches): gate_up + SiLU·mul, a grid
barrier, then down_proj feeding the residual stream.

    fused_decode_mlp(x [M, K], sumsq [M, cdiv(K, 32)], eps, w_gate_up [2I, K], w_down [N, I], stream [M, N] float32,
                     work: FusedMlpWork, config=DEFAULT_CONFIG) -> (out [M, N], sumsq_out [M, cdiv(N, 32)])

What the two launches of a folded decode layer compute (runtime/models/norm_fold.py): `small_m_gemm_silu_mul(x,
w_gate_up, sumsq=sumsq, eps=eps)` (each row's sums scaled by 1 / rms from the sums of squares o_proj left, then
silu(gate) * up, rounded as that launch rounds it) and `small_m_gemm_splitk_to_stream(h, w_down, counters, stream)`
(stream += h @ w_down^T in place, out the new stream rounded to x's dtype, sumsq_out its sums of squares per 32
columns). Here one launch of P programs, all resident at once, does both:

1. gate_up units: a unit is BLOCK_I intermediate columns (their gate and up weight rows over the whole K), run with
   the small-M kernel's own loop and epilogue (`gemm_small_m._row_sums`, `store_out`); h [M, I] goes to a buffer;
2. a grid barrier (sits.kernels.grid_barrier): every h column is written;
3. down units: a unit is BLOCK_N stream columns over one of K_SPLIT equal slices of I; each stores its float32
   partial, and the last of a column tile's K_SPLIT units to arrive adds them in slice order and runs the
   stream epilogue (`add_to_stream`), as the split-K kernel does.

With a config's PREFETCH > 0 (sm_90 and later), each program queues the first PREFETCH bytes of every weight row of
its first down unit for L2 before it waits at the barrier, so HBM keeps streaming while the last gate_up units end.

So a decode layer's MLP pays one launch instead of two, and the programs that finish their gate_up units early do
not leave HBM idle until the last one does: they start on the down weight as soon as the barrier opens, with no
second launch's start in between. Whether that is faster is measured, not assumed: `benchmarks/bench_fused_mlp.py`
and the decode step with SITS_FUSED_MLP=1 (`prof1-fmlp`). The engine uses it only when switched on.

P = the number of down units; the grid must fit the GPU at once (`fits_at_once`: registers and shared memory of the
compiled kernel against the multiprocessors), and the launch is cooperative (CUDA refuses a grid that cannot be
resident). The buffers (`FusedMlpWork`) belong to the caller and must outlive the launch and any CUDA graph that
captures it; launches sharing them run one after another (one stream). Under Triton's interpreter, which runs
programs one after another, the launch is one program that runs every unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sits.kernels.gemm_small_m import (
    SUMSQ_GROUP,
    _row_sums,
    add_to_stream,
    load_row_squares,
    load_stream_tile,
    row_rstd,
    store_out,
    sumsq_slots,
)
from sits.kernels.grid_barrier import grid_barrier, grid_barrier_reset
from sits.kernels.l2_prefetch import _bulk_prefetch, l2_prefetch_supported
from sits.kernels.last_arrival import last_arrival
from sits.kernels.launch_utils import check_inner_contiguous, check_tensor, is_interpreter, num_sms, require

__all__ = ["DEFAULT_CONFIG", "MAX_ROWS", "FusedMlpWork", "config_divides", "fits_at_once", "fused_decode_mlp"]

MAX_ROWS = 16  # one 16-row x tile (the swapped dots' N side): batches of 1 to 16
MAX_SPLIT = 8  # slices of I a column tile's down units may take (the partials' buffer is sized for it)
SPIN_LIMIT = 1 << 24  # polls before a barrier gives up (the flag says so): a guard, never reached when all fit
# The launch: BLOCK_I intermediate columns a gate_up unit, BLOCK_N stream columns and K_SPLIT slices a down unit,
# BLOCK_K columns of K a loop step, warps and pipeline stages; PREFETCH (optional, default 0) bytes of each of the
# first down unit's weight rows queued for L2 before the barrier. 448 programs (4 an SM on 132 SMs, 40 KB of shared
# memory and 128 registers each on sm_90a), one gate_up and one down unit each at Llama-3-8B's shapes.
DEFAULT_CONFIG = {"BLOCK_I": 32, "BLOCK_N": 64, "K_SPLIT": 7, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}


@dataclass
class FusedMlpWork:
    """The launch's buffers on one device, zero where they count: ws [MAX_SPLIT, MAX_ROWS, N] float32 (the down
    units' partials); tiles [cdiv(N, SUMSQ_GROUP)] int32 (a counter per down column tile, zero again after each
    launch); barrier [2] int32 (the grid barrier's counter, zero after each launch, and its gave-up flag); h
    [MAX_ROWS, I] in the model dtype (the SiLU·mul output)."""

    ws: torch.Tensor
    tiles: torch.Tensor
    barrier: torch.Tensor
    h: torch.Tensor

    @classmethod
    def new(cls, n: int, intermediate: int, dtype: torch.dtype, device: torch.device) -> FusedMlpWork:
        ints = {"dtype": torch.int32, "device": device}
        return cls(torch.zeros(MAX_SPLIT * MAX_ROWS * n, dtype=torch.float32, device=device),
                   torch.zeros(triton.cdiv(n, SUMSQ_GROUP), **ints), torch.zeros(2, **ints),
                   torch.zeros(MAX_ROWS, intermediate, dtype=dtype, device=device))

    def gave_up(self) -> bool:
        """Whether a launch's barrier polls gave up (a host sync: for tests and benchmarks)."""
        return bool(int(self.barrier[1].item()))


@triton.jit
def _gate_up_units(x_ptr, sumsq_ptr, w_ptr, h_ptr, M, K, INTER, eps, stride_xm, stride_qm, stride_hm,
                   BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, RSTD_SLOTS: tl.constexpr, DOT_FP32: tl.constexpr):
    """This program's gate_up + SiLU·mul units (pid, pid + P, ...): h[:, unit's columns] from rows scaled by 1 / rms."""
    offs_m = tl.arange(0, 16)
    in_m = offs_m < M
    rstd = row_rstd(load_row_squares(sumsq_ptr, offs_m, in_m, stride_qm, K, RSTD_SLOTS), K, eps)
    r = tl.arange(0, 2 * BLOCK_I)
    for unit in range(tl.program_id(0), INTER // BLOCK_I, tl.num_programs(0)):
        rows_w = (unit * BLOCK_I + r % BLOCK_I + (r // BLOCK_I) * INTER).to(tl.int64)
        sums = _row_sums(x_ptr, w_ptr, offs_m.to(tl.int64), in_m, rows_w, K, stride_xm, K, 16, 2 * BLOCK_I,
                         BLOCK_K, True, True, DOT_FP32)
        store_out(h_ptr, sums * rstd[:, None], offs_m, unit * BLOCK_I + tl.arange(0, BLOCK_I), in_m, INTER, stride_hm,
                  16, BLOCK_I, True)


@triton.jit
def _down_units(h_ptr, w_ptr, stream_ptr, out_ptr, sumsq_out_ptr, ws_ptr, tiles_ptr, M, N, INTER, stride_hm,
                stride_sm, stride_om, stride_qm, BLOCK_N: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """This program's down units: each slice's partial to ws, the tile's last arrival feeds the stream."""
    offs_m = tl.arange(0, 16)
    in_m = offs_m < M
    tiles = tl.cdiv(N, BLOCK_N)
    span = INTER // K_SPLIT
    for unit in range(tl.program_id(0), tiles * K_SPLIT, tl.num_programs(0)):
        tile, part = unit % tiles, unit // tiles
        col0 = tile * BLOCK_N
        old = load_stream_tile(stream_ptr, offs_m, col0, in_m, N, stride_sm, BLOCK_N)
        rows_w = tl.minimum(col0 + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
        sums = _row_sums(h_ptr + part * span, w_ptr + part * span, offs_m.to(tl.int64), in_m, rows_w, span,
                         stride_hm, INTER, 16, BLOCK_N, BLOCK_K, True, True, DOT_FP32)
        slot = offs_m[:, None] * N + (col0 + tl.arange(0, BLOCK_N))[None, :]
        mask = in_m[:, None] & ((col0 + tl.arange(0, BLOCK_N)) < N)[None, :]
        tl.store(ws_ptr + part * 16 * N + slot, sums, mask=mask)
        if last_arrival(tiles_ptr + tile, K_SPLIT):
            acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(K_SPLIT):
                acc += tl.load(ws_ptr + s * 16 * N + slot, mask=mask, other=0.0, cache_modifier=".cg")
            add_to_stream(stream_ptr, out_ptr, sumsq_out_ptr, old, acc, offs_m, col0, in_m, N, stride_sm, stride_om,
                          stride_qm, BLOCK_N)


@triton.jit
def _prefetch_first_down_unit(w_ptr, N, INTER, BLOCK_N: tl.constexpr, K_SPLIT: tl.constexpr,
                              PREFETCH: tl.constexpr):
    """Queue the first PREFETCH bytes of each weight row of this program's first down unit (its id) for L2."""
    tiles = tl.cdiv(N, BLOCK_N)
    unit = tl.program_id(0)
    rows = tl.minimum((unit % tiles) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    starts = w_ptr + rows * INTER + (unit // tiles) * (INTER // K_SPLIT)
    _bulk_prefetch(starts, tl.full([BLOCK_N], PREFETCH, tl.int32), False)


@triton.jit
def _fused_mlp_kernel(
    x_ptr, sumsq_ptr, w_gate_up_ptr, w_down_ptr, stream_ptr, out_ptr, sumsq_out_ptr, h_ptr, ws_ptr, tiles_ptr,
    barrier_ptr, spin_limit, M, K, INTER, N, eps, stride_xm, stride_qm, stride_hm, stride_sm, stride_om, stride_qom,
    BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
    RSTD_SLOTS: tl.constexpr, DOT_FP32: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """Grid (P,): the gate_up units, the grid barrier, the down units (see the module docstring)."""
    _gate_up_units(x_ptr, sumsq_ptr, w_gate_up_ptr, h_ptr, M, K, INTER, eps, stride_xm, stride_qm, stride_hm,
                   BLOCK_I, BLOCK_K, RSTD_SLOTS, DOT_FP32)
    if PREFETCH > 0:
        _prefetch_first_down_unit(w_down_ptr, N, INTER, BLOCK_N, K_SPLIT, PREFETCH)
    grid_barrier(barrier_ptr, tl.num_programs(0), barrier_ptr + 1, spin_limit)
    _down_units(h_ptr, w_down_ptr, stream_ptr, out_ptr, sumsq_out_ptr, ws_ptr, tiles_ptr, M, N, INTER, stride_hm,
                stride_sm, stride_om, stride_qom, BLOCK_N, K_SPLIT, BLOCK_K, DOT_FP32)
    grid_barrier_reset(barrier_ptr, 2 * tl.num_programs(0))


def config_divides(config: dict, k: int, intermediate: int, n: int) -> bool:
    """Whether `config`'s tiles divide the shapes: x [M, k], w_gate_up [2 intermediate, k], w_down [n, intermediate]
    (whole K tiles in both loops, equal slices of I, stream tiles of whole sum-of-squares slots, a prefetch of whole
    16-byte lines within a bf16 slice)."""
    span, rest = divmod(intermediate, config["K_SPLIT"])
    prefetch = config.get("PREFETCH", 0)
    return (prefetch % 16 == 0 and 0 <= prefetch <= 2 * span and intermediate % config["BLOCK_I"] == 0 and rest == 0 and span % config["BLOCK_K"] == 0
            and k % config["BLOCK_K"] == 0 and config["K_SPLIT"] <= MAX_SPLIT and config["BLOCK_N"] % SUMSQ_GROUP == 0
            and n % config["BLOCK_N"] == 0)


def _programs(config: dict, n: int) -> int:
    """P: one program a down unit."""
    return triton.cdiv(n, config["BLOCK_N"]) * config["K_SPLIT"]


def _check_shapes(x, sumsq, w_gate_up, w_down, stream, work: FusedMlpWork, config: dict) -> None:
    m, k = x.shape
    intermediate, n = w_down.shape[1], w_down.shape[0]
    require(1 <= m <= MAX_ROWS, f"fused_decode_mlp takes 1 to {MAX_ROWS} rows, got {m}")
    require(x.dtype in (torch.float16, torch.bfloat16), f"x must be float16 or bfloat16, got {x.dtype}")
    for name, t, shape, dtype in (("w_gate_up", w_gate_up, (2 * intermediate, k), x.dtype),
                                  ("w_down", w_down, (n, intermediate), x.dtype),
                                  ("sumsq", sumsq, (m, sumsq_slots(k)), torch.float32),
                                  ("stream", stream, (m, n), torch.float32)):
        check_tensor(t, name, ndim=2, dtypes=(dtype,), device=x.device)
        require(tuple(t.shape) == shape, f"{name} must be {list(shape)}, got {list(t.shape)}")
        check_inner_contiguous(t, name)
    require(w_down.is_contiguous() and w_gate_up.is_contiguous(), "the weights must be contiguous")
    require(config_divides(config, k, intermediate, n), f"config {config} does not divide K = {k}, I = {intermediate}")
    require(not config.get("PREFETCH", 0) or is_interpreter() or l2_prefetch_supported(x.device),
            "PREFETCH needs sm_90 or later (bulk L2 prefetches)")
    require(work.ws.numel() >= MAX_SPLIT * MAX_ROWS * n and work.tiles.numel() >= triton.cdiv(n, SUMSQ_GROUP)
            and tuple(work.h.shape) == (MAX_ROWS, intermediate) and work.h.dtype == x.dtype,
            "work buffers too small for these shapes")


def _args(x, sumsq, eps, w_gate_up, w_down, stream, work, out, sumsq_out):
    m, k = x.shape
    return (x, sumsq, w_gate_up, w_down, stream, out, sumsq_out, work.h, work.ws, work.tiles, work.barrier,
            SPIN_LIMIT, m, k, w_down.shape[1], w_down.shape[0], float(eps), x.stride(0), sumsq.stride(0),
            work.h.stride(0), stream.stride(0), out.stride(0), sumsq_out.stride(0))


def _meta(config: dict, k: int) -> dict:
    """The launch's keyword arguments: the config's, with the constexprs it leaves to the call."""
    return {**config, "RSTD_SLOTS": triton.next_power_of_2(sumsq_slots(k)), "DOT_FP32": is_interpreter(),
            "PREFETCH": 0 if is_interpreter() else config.get("PREFETCH", 0)}


def fits_at_once(x, sumsq, eps, w_gate_up, w_down, stream, work: FusedMlpWork,
                 config: dict | None = None) -> bool:
    """Whether the launch's P programs fit the GPU at once (compiles the binary `fused_decode_mlp` launches for these
    arguments; the interpreter's single program always fits)."""
    config = DEFAULT_CONFIG if config is None else config
    if is_interpreter():
        return True
    out = torch.empty_like(x)
    sumsq_out = torch.empty(x.shape[0], sumsq_slots(w_down.shape[0]), dtype=torch.float32, device=x.device)
    kernel = _fused_mlp_kernel.warmup(*_args(x, sumsq, eps, w_gate_up, w_down, stream, work, out, sumsq_out),
                                      grid=(1,), launch_cooperative_grid=True, **_meta(config, x.shape[1]))
    kernel._init_handles()
    props = torch.cuda.get_device_properties(x.device)
    threads = 32 * config["num_warps"]
    regs = -(-max(kernel.n_regs, 1) // 8) * 8  # allocated per thread in steps of 8
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs * threads)
    by_smem = props.shared_memory_per_multiprocessor // max(kernel.metadata.shared + 1024, 1)
    by_threads = props.max_threads_per_multi_processor // threads
    return _programs(config, w_down.shape[0]) <= min(by_regs, by_smem, by_threads) * num_sms(x.device)


def fused_decode_mlp(x: torch.Tensor, sumsq: torch.Tensor, eps: float, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, stream: torch.Tensor, work: FusedMlpWork,
                     config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """stream += down(silu(gate(x') ) * up(x')) in place, x' = x's rows scaled by 1 / rms (see the module doc).

    Args:
        x: [M, K] bfloat16 / float16, 1 <= M <= MAX_ROWS, last dimension contiguous: the stream rounded, as o_proj's
            folded launch wrote it.
        sumsq: [M, cdiv(K, 32)] float32, the stream's sums of squares per 32 columns (o_proj's).
        eps: the norm's epsilon.
        w_gate_up: [2I, K] in x's dtype, contiguous (gate rows, then up; the norm weight folded in).
        w_down: [N, I] in x's dtype, contiguous.
        stream: [M, N] float32, the residual stream, updated in place.
        work: the launch's buffers (`FusedMlpWork.new(N, I, x.dtype, device)`), zero where they count.
        config: launch config (DEFAULT_CONFIG's keys); the caller checks `fits_at_once` with it once.
    Returns:
        (out [M, N] the new stream rounded to x's dtype, sumsq_out [M, cdiv(N, 32)] float32 its sums of squares).
    Raises:
        ValueError: wrong shapes, dtypes, layout, device or a config that does not divide the shapes.
    """
    config = DEFAULT_CONFIG if config is None else config
    _check_shapes(x, sumsq, w_gate_up, w_down, stream, work, config)
    out = torch.empty_like(x)
    sumsq_out = torch.empty(x.shape[0], sumsq_slots(w_down.shape[0]), dtype=torch.float32, device=x.device)
    programs = 1 if is_interpreter() else _programs(config, w_down.shape[0])
    _fused_mlp_kernel[(programs,)](*_args(x, sumsq, eps, w_gate_up, w_down, stream, work, out, sumsq_out),
                                   launch_cooperative_grid=not is_interpreter(), **_meta(config, x.shape[1]))
    return out, sumsq_out
