"""The small-M GEMM with an equal share of the weight per program (stream-K), reduced in the same launch.

    small_m_gemm_streamk(x [M, K], w [N, K], counters [>= counters_needed(N)] int32, zero) -> out [M, N] = x @ w^T

Why: at decode every projection only streams its weight, and Nsight Compute (benchmarks/ncu_decode_kernels.py on
an H200, 2026-12-04) shows the short ones' multiprocessors idle a third of the time. The direct and split-K kernels
give each program whole (column tile, K slice) pieces, so the grid is a whole number of pieces, and the work per
multiprocessor is as even as that number allows: qkv_proj at 6,144 columns runs 96 programs on 132 multiprocessors
(SMs active 62 % of its 16.4 µs, DRAM at 67 % of peak), o_proj 128 (70 % active, 53 % of peak), while gate_up's 448
programs reach 89 %.

Here the grid is P programs (a whole number per multiprocessor), and the work is U = column tiles x K tiles
units of one [BLOCK_N, BLOCK_K] weight tile each, in column-tile-major order. Program p streams units
[p U / P, (p + 1) U / P): within a column tile its units are one contiguous K range, so a program runs one K loop
per column tile it touches (at most a few). A column tile whose units one program holds is written directly;
one shared by several programs (its "segments", in program order) is reduced as the split-K kernel reduces
(sits.kernels.gemm_small_m_splitk): each segment stores its float32 partial in its own workspace slot, counts
itself on the tile's counter, and the last to arrive adds the slots in segment order (the same sums whatever
order the programs ran in), writes out in x's dtype and sets the counter back to 0.

Configs (BLOCK_N, BLOCK_K, num_warps, num_stages, PROGRAMS_PER_SM, W_TMA) are pinned by the caller; no autotuning.
W_TMA = 1 reads the weight tiles through a tensor descriptor (TMA on sm_90: one bulk copy a tile instead of a
16-byte load per thread, for the few warps a multiprocessor runs here) instead of pointer loads.

The folded decoder norms' epilogues (`small_m_gemm_streamk(..., sumsq=)`, `small_m_gemm_streamk_to_stream`) run in
whichever program writes a tile. Compiled for sm_90a by Triton 3.9 (benchmarks/sm90_compile.py), their pointer
path's K loop is not software-pipelined (about 230 registers and 32-48 KB of shared memory, against 80 registers
and 82 KB for the plain GEMM), while the TMA path is (71-128 registers, 82-98 KB).

Measured on an H200 (2026-12-04, benchmarks/bench_gemm_small_m_streamk.py, Llama-3-8B's projections at M = 1 and
32, plain and folded): the best config per projection was 1.00-1.13x slower than the launch the small-M table
routes to, and 0.90-1.05x against cuBLAS. The TMA path was no faster than pointer loads. The one exception, batch
1's folded qkv_proj (17.0 against 18.5 µs at the bench's default direct tiles), does not hold in the engine, whose
pinned tiles take about 15-16 µs there (benchmarks/profile_decode.py at batch 1). The engine does not use
this kernel; it stays, with its tests, as the measured answer to the profile above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sits.kernels.gemm_small_m import (
    _block_m,
    _row_sums,
    add_to_stream,
    check_gemm_operands,
    check_row_squares,
    check_stream,
    fold_arguments,
    load_row_squares,
    load_stream_tile,
    row_rstd,
    small_m_rows_bucket,
    store_out,
    sumsq_slots,
)
from sits.kernels.gemm_small_m_splitk import check_counters, counters_needed
from sits.kernels.last_arrival import last_arrival
from sits.kernels.launch_utils import is_interpreter, num_sms, require
from sits.kernels.reference import small_m_gemm_reference

__all__ = [
    "STREAMK_CONFIG_KEYS",
    "counters_needed",
    "small_m_gemm_reference",
    "small_m_gemm_streamk",
    "small_m_gemm_streamk_to_stream",
    "streamk_plan",
]

STREAMK_CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "PROGRAMS_PER_SM", "W_TMA")
GPU_CONFIG = dict(zip(STREAMK_CONFIG_KEYS, (64, 128, 4, 4, 1, 0), strict=True))
INTERPRETER_CONFIG = dict(zip(STREAMK_CONFIG_KEYS, (32, 32, 4, 1, 1, 0), strict=True))


@triton.jit
def _owner(u, P, U):
    """The program whose range [p U / P, (p + 1) U / P) holds unit u."""
    return ((u + 1) * P - 1) // U


@triton.jit
def _row_sums_tma(x_ptr, w_desc, offs_m, in_m, row0, k0, k_end, stride_xm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """float32 sums of x[:, k0:k_end] @ w[row0 : row0 + BLOCK_N, k0:k_end]^T, [BLOCK_M, BLOCK_N], the weight tiles
    read through the tensor descriptor w_desc (TMA on sm_90: zeros past its rows and K), swapped operands."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kk in range(k0, k_end, BLOCK_K):
        w = w_desc.load([row0, kk])
        k = kk + offs_k
        x = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + k[:, None],
                    mask=in_m[None, :] & (k[:, None] < k_end), other=0.0)  # fmt: skip
        if DOT_FP32:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, x, acc)
    return tl.trans(acc)


@triton.jit
def _write_tile(out_ptr, stream_ptr, sumsq_ptr, sums, rstd, offs_m, col0, in_m, N, stride_om, stride_sm, stride_qm,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STREAM: tl.constexpr, RSTD_SLOTS: tl.constexpr):  # fmt: skip
    """A tile's whole float32 sums [BLOCK_M, BLOCK_N] (columns col0 + [0, BLOCK_N)) into out, scaled by the rows'
    rstd with RSTD_SLOTS, or added to the stream with STREAM (the one program that writes the tile reads the
    stream tile here, so no other program touches it)."""
    if RSTD_SLOTS:
        sums = sums * rstd[:, None]
    if STREAM:
        old = load_stream_tile(stream_ptr, offs_m, col0, in_m, N, stride_sm, BLOCK_N)
        add_to_stream(stream_ptr, out_ptr, sumsq_ptr, old, sums, offs_m, col0, in_m, N, stride_sm, stride_om,
                      stride_qm, BLOCK_N)  # fmt: skip
    else:
        store_out(
            out_ptr, sums, offs_m, col0 + tl.arange(0, BLOCK_N), in_m, N, stride_om, BLOCK_M, BLOCK_N, False
        )


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary per row tile, not per batch size
def _streamk_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, counters_ptr, M, N, K, stride_xm, stride_wn, stride_om, M_BUCKET, max_segments,
    stream_ptr, sumsq_ptr, stride_sm, stride_qm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr, W_TMA: tl.constexpr = False, STREAM: tl.constexpr = False, RSTD_SLOTS: tl.constexpr = 0,
):  # fmt: skip
    """out [M, N] = x @ w^T; grid (P,). See the module docstring. ws: [column tiles, max_segments, BLOCK_M,
    BLOCK_N] float32 slots; counters: one int32 per column tile, 0 before the launch and after it. W_TMA: w_ptr is
    a tensor descriptor of w with [BLOCK_N, BLOCK_K] blocks (`_row_sums_tma`), else the weight's pointer.
    The folded decoder norms' epilogues, as the direct kernel's (sits.kernels.gemm_small_m), applied by whichever
    program writes a tile: RSTD_SLOTS > 0 scales each row by rsqrt(mean square + eps) from sumsq [M, cdiv(K, 32)];
    STREAM adds the sums to the float32 stream [M, N] in place, writes the new stream rounded to out and its sums
    of squares to sumsq [M, cdiv(N, 32)]."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    units = tl.cdiv(N, BLOCK_N) * k_tiles
    u = pid * units // programs
    u_end = (pid + 1) * units // programs
    offs_m = tl.arange(0, BLOCK_M)
    in_m = offs_m < M
    local = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    rstd = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if RSTD_SLOTS:
        rstd = row_rstd(load_row_squares(sumsq_ptr, offs_m, in_m, stride_qm, K, RSTD_SLOTS), K, eps)
    while u < u_end:
        tile = u // k_tiles
        t0 = u - tile * k_tiles
        t1 = tl.minimum(k_tiles, t0 + (u_end - u))
        k0 = t0 * BLOCK_K
        if W_TMA:
            sums = _row_sums_tma(x_ptr, w_ptr, offs_m, in_m, tile * BLOCK_N, k0, tl.minimum(t1 * BLOCK_K, K),
                                 stride_xm, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)  # fmt: skip
        else:  # the weight rows of the tile, wrapped into [0, N) (columns past N are masked at the store)
            rows_w = ((tile * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
            sums = _row_sums(x_ptr + k0, w_ptr + k0, offs_m.to(tl.int64), in_m, rows_w,
                             tl.minimum(t1 * BLOCK_K, K) - k0, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, True,
                             EVEN_K, DOT_FP32)  # fmt: skip
        first = _owner(tile * k_tiles, programs, units)
        segments = _owner(tile * k_tiles + k_tiles - 1, programs, units) - first + 1
        if segments == 1:
            _write_tile(out_ptr, stream_ptr, sumsq_ptr, sums, rstd, offs_m, tile * BLOCK_N, in_m, N, stride_om,
                        stride_sm, stride_qm, BLOCK_M, BLOCK_N, STREAM, RSTD_SLOTS)  # fmt: skip
        else:
            slots = ws_ptr + (tile * max_segments).to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(slots + (pid - first) * (BLOCK_M * BLOCK_N) + local, sums)
            if last_arrival(counters_ptr + tile, segments):
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(segments):  # in segment order: the same sums whatever order they arrived in
                    acc += tl.load(slots + s * (BLOCK_M * BLOCK_N) + local, cache_modifier=".cg")
                _write_tile(out_ptr, stream_ptr, sumsq_ptr, acc, rstd, offs_m, tile * BLOCK_N, in_m, N, stride_om,
                            stride_sm, stride_qm, BLOCK_M, BLOCK_N, STREAM, RSTD_SLOTS)  # fmt: skip
        u += t1 - t0


def streamk_plan(n: int, k: int, block_n: int, block_k: int, programs: int) -> tuple[int, int]:
    """(programs launched, segment slots per column tile) for an [n, k] weight: at most one program per unit,
    and room for every program that can touch a tile (each holds at least units // programs units)."""
    k_tiles = triton.cdiv(k, block_k)
    units = triton.cdiv(n, block_n) * k_tiles
    programs = max(1, min(programs, units))
    return programs, triton.cdiv(k_tiles, units // programs) + 1


def _checked_config(config: dict[str, int] | None) -> dict[str, int]:
    config = dict(INTERPRETER_CONFIG if is_interpreter() else GPU_CONFIG) if config is None else dict(config)
    require(set(config) == set(STREAMK_CONFIG_KEYS), f"a stream-K config has exactly {', '.join(STREAMK_CONFIG_KEYS)}, "
            f"got {config!r}")  # fmt: skip
    require(all(isinstance(v, int) and v > 0 for key, v in config.items() if key != "W_TMA"),
            f"config values must be positive: {config!r}")  # fmt: skip
    require(config["W_TMA"] in (0, 1), f"W_TMA is 0 or 1, got {config['W_TMA']!r}")
    require(
        config["BLOCK_N"] >= 32 and config["BLOCK_N"] & (config["BLOCK_N"] - 1) == 0,
        f"BLOCK_N must be a power of two >= 32 (the counters' tile), got {config['BLOCK_N']}",
    )
    return config


def small_m_gemm_streamk(
    x: torch.Tensor,
    w: torch.Tensor,
    counters: torch.Tensor,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    programs: int | None = None,
    sumsq: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """out = x @ w^T with float32 sums, the weight shared evenly over the programs.

    Args:
        x, w, counters, out: as gemm_small_m_splitk.small_m_gemm_splitk's (x [M <= 64, K] half precision, w
            [N, K], counters zero before and after the launch, out an optional [M, N] buffer).
        config: STREAMK_CONFIG_KEYS (default GPU_CONFIG; INTERPRETER_CONFIG under the interpreter).
        programs: the grid, default PROGRAMS_PER_SM x the device's multiprocessors (at most one per unit).
        sumsq, eps: as gemm_small_m.small_m_gemm's (each row scaled by the folded norm's 1 / rms).
    Returns [M, N] in x's dtype; raises ValueError on bad operands (as the split-K kernel) or a bad config.
    """
    m, n = check_gemm_operands(x, w, out, None, "w")
    if sumsq is not None:
        check_row_squares(sumsq, m, x.shape[1], x)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, w, counters, out, config, programs, None, sumsq, eps)
    return out


def small_m_gemm_streamk_to_stream(
    x: torch.Tensor,
    w: torch.Tensor,
    counters: torch.Tensor,
    stream: torch.Tensor,
    config: dict[str, int] | None = None,
    programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """stream += x @ w^T in place: gemm_small_m.small_m_gemm_to_stream's contract (returns out, the new stream
    rounded to x's dtype, and sumsq [M, cdiv(N, 32)], its sums of squares) on this kernel; the other arguments as
    small_m_gemm_streamk's. Raises ValueError as it does, or on a stream of another shape, dtype or device."""
    m, n = check_gemm_operands(x, w, None, None, "w")
    check_stream(stream, m, n, x)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    sumsq = torch.empty(m, sumsq_slots(n), dtype=torch.float32, device=x.device)
    _launch(x, w, counters, out, config, programs, stream, sumsq, 0.0)
    return out, sumsq


def _launch(x, w, counters, out, config, programs, stream, sumsq, eps) -> None:
    """Check the counters and config, plan the grid and launch (nothing for an empty product). With `stream`, the
    launch feeds it and writes `sumsq`; else a given `sumsq` scales the rows."""
    m, n = out.shape
    check_counters(counters, n, x.device)
    config = _checked_config(config)
    if not (m and n):
        return
    k = x.shape[1]
    block_m, block_n, block_k = _block_m(m), config["BLOCK_N"], config["BLOCK_K"]
    wanted = programs if programs is not None else config["PROGRAMS_PER_SM"] * num_sms(x.device)
    require(wanted >= 1, f"programs must be positive, got {wanted}")
    grid, segments = streamk_plan(n, k, block_n, block_k, wanted)
    ws = torch.empty(
        triton.cdiv(n, block_n) * segments * block_m * block_n, dtype=torch.float32, device=x.device
    )
    fold_args, fold_meta = fold_arguments(x, stream, sumsq, eps, scale_rows=stream is None)
    _streamk_kernel[(grid,)](
        x, _weight_operand(w, config), out, ws, counters, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        small_m_rows_bucket(m), segments, *fold_args,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, DOT_FP32=is_interpreter(),
        W_TMA=bool(config["W_TMA"]), num_warps=config["num_warps"], num_stages=config["num_stages"], **fold_meta,
    )  # fmt: skip


def _weight_operand(w: torch.Tensor, config: dict[str, int]):
    """The weight as the kernel reads it: its tensor, or with W_TMA a tensor descriptor of [BLOCK_N, BLOCK_K]
    blocks (its row stride and address must be multiples of 16 bytes)."""
    if not config["W_TMA"]:
        return w
    require(w.stride(0) * w.element_size() % 16 == 0 and w.data_ptr() % 16 == 0,
            "W_TMA needs the weight's address and row stride in multiples of 16 bytes")  # fmt: skip
    return TensorDescriptor.from_tensor(w, [config["BLOCK_N"], config["BLOCK_K"]])
