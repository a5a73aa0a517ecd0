"""The small-M GEMM with K split over programs and the splits reduced in the same launch (decode batches).

    small_m_gemm_splitk(x [M, K], w [N, K], counters [>= counters_needed(N)] int32, zero) -> out [M, N] = x @ w^T

The direct kernel (sits.kernels.gemm_small_m) gives each program a whole-K column tile. Every program also
reads all M activation rows over the whole K, from L2: M / BLOCK_N bytes of activation per weight byte. At
M = 32 and the narrow tiles that keep N = 4,096 (o_proj, down_proj) spread over 132 multiprocessors that is as
much L2 traffic as weight traffic. Here a program takes a wider column tile (32 to 128 weight rows; from
64 a wgmma's M side, swapped) over one of SPLIT_K slices of K, so the grid stays as wide and the activation
re-reads shrink by BLOCK_N / 32. cuBLAS splits K too, and adds a reduction kernel; this kernel reduces in
the same launch:

1. each program stores its float32 partial [M, BLOCK_N] into a workspace slot of its own
   (ws[split, m, n], allocated per call: no launch);
2. it counts itself on its column tile's int32 counter (`counters`, zero before the launch: the
   release / acquire protocol of the decode attention's fused merge, sits.kernels.last_arrival);
3. the last of the tile's SPLIT_K programs to arrive adds the partials in split order 0, 1, ... (the same
   sums whatever order the programs ran in), writes out in x's dtype and sets the counter back to 0.

`small_m_gemm_splitk_to_stream(x, w, counters, stream)` is gemm_small_m.small_m_gemm_to_stream on this kernel: the
last arrival adds the tile's sums to the float32 stream and writes the rounded copy and the sums of squares.

So the counters belong to the caller and must outlive the launch (and any CUDA graph that captures it):
`DecodeLinear` keeps one buffer per layer. Configs (BLOCK_N, BLOCK_K, warps, stages, SPLIT_K) are autotuned
per (N, K, bucket of M) and dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.gemm_small_m import (
    SMEM_BYTES,
    _block_m,
    _row_sums,
    _weight_rows,
    add_to_stream,
    check_gemm_operands,
    check_stream,
    fold_arguments,
    load_stream_tile,
    pinned_meta,
    shared_memory_bytes,
    small_m_rows_bucket,
    store_out,
    sumsq_slots,
    x_element_bytes,
)
from sits.kernels.last_arrival import last_arrival
from sits.kernels.launch_utils import autotune, check_tensor, is_interpreter, require
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.reference import small_m_gemm_reference
from sits.kernels.small_m_table import SPLITK_CONFIG_KEYS

__all__ = ["MAX_SPLIT_K", "MIN_BLOCK_N", "counters_needed", "small_m_gemm_splitk", "small_m_gemm_splitk_to_stream",
           "small_m_gemm_reference"]

MAX_SPLIT_K = 8  # the workspace is sized for the widest split of any config
MIN_BLOCK_N = 32  # the narrowest column tile of any config: one counter per tile of it


def _config(block_n: int, block_k: int, warps: int, stages: int, split_k: int) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "SWAP_AB": True, "SPLIT_K": split_k},
                         num_warps=warps, num_stages=stages)


# (BLOCK_N, BLOCK_K, warps, stages, SPLIT_K): at N = 4,096, 128 programs (64 columns x 2 splits) to 512.
# Measured on the H200 (2026-12-03, benchmarks/bench_gemm_small_m.py, CUDA graphs): 64 x 256 in 2 splits was the
# fastest or within 2 % at o_proj and down_proj at batches 1 and 32 (o: 11.65 µs at 1, 13.03 at 32, against
# cuBLAS's 13.32 and 14.26); more splits lost (4: +2-4 µs, 8: +5-7 µs). At qkv_proj and gate_up the wider
# tiles leave too few columns per program's pipeline: the direct kernel or cuBLAS win there.
GPU_CONFIGS = [
    _config(*c)
    for c in (
        (64, 256, 4, 4, 2), (64, 256, 4, 4, 4), (64, 128, 4, 6, 4), (64, 128, 4, 6, 8), (128, 128, 8, 4, 4),
        (128, 128, 8, 4, 8), (128, 64, 8, 6, 8), (32, 256, 4, 4, 4),
    )
]
INTERPRETER_CONFIG = _config(32, 32, 4, 1, 3)


def _prune(configs, named_args, **kwargs):
    """The configs whose pipeline fits shared memory at this row tile, less those whose K slices would be mostly
    empty (BLOCK_K x SPLIT_K past K); where that leaves none, the fitting one with the fewest K elements a step."""
    k = named_args["K"]
    block_m = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", 64))
    fitting = [c for c in configs if _smem(c, block_m, x_element_bytes(named_args)) <= SMEM_BYTES] or configs[:1]
    kept = [c for c in fitting if c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"] <= max(k, 128)]
    return kept or [min(fitting, key=lambda c: c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"])]


def _smem(config: triton.Config, block_m: int, x_bytes: int = 2) -> int:
    """`gemm_small_m.shared_memory_bytes` of a split-K config (x_bytes 4: float32 activations)."""
    return shared_memory_bytes(config, block_m, x_bytes=x_bytes)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary per row tile, not per batch size
def _splitk_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, counters_ptr, M, N, K, stride_xm, stride_wn, stride_om, M_BUCKET,
    stream_ptr, sumsq_ptr, stride_sm, stride_qm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, USE_PDL: tl.constexpr = False,
    STREAM: tl.constexpr = False, RSTD_SLOTS: tl.constexpr = 0,
):  # fmt: skip
    """out [M, N] = x @ w^T; grid (cdiv(N, BLOCK_N), SPLIT_K). Program (j, s) sums K slice s (a whole number of
    BLOCK_K tiles) of column tile j into ws[s] ([SPLIT_K, BLOCK_M, N] float32), and the tile's last arrival on
    counters[j] adds ws[0..SPLIT_K) in that order and writes out; with STREAM it adds that to the float32 stream
    instead and writes the new stream rounded, and its sums of squares (gemm_small_m.add_to_stream).
    RSTD_SLOTS is not taken here (the row-scaled launches run the direct kernel); eps is unused."""
    pdl_wait(USE_PDL)
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    in_m = offs_m < M
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * k_per_split
    k_len = tl.maximum(tl.minimum(k_per_split, K - k_start), 0)
    if STREAM:  # every program of the tile loads it (its last arrival will need it): no load in the epilogue
        old = load_stream_tile(stream_ptr, offs_m, pid_n * BLOCK_N, in_m, N, stride_sm, BLOCK_N)
    sums = _row_sums(x_ptr + k_start, w_ptr + k_start, offs_m.to(tl.int64), in_m, _weight_rows(N, BLOCK_N, False),
                     k_len, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, EVEN_K, DOT_FP32)  # fmt: skip
    tile = offs_m[:, None] * N + offs_n[None, :]
    mask = in_m[:, None] & (offs_n[None, :] < N)
    tl.store(ws_ptr + split * BLOCK_M * N + tile, sums, mask=mask)
    if last_arrival(counters_ptr + pid_n, SPLIT_K):
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + s * BLOCK_M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
        if STREAM:
            add_to_stream(stream_ptr, out_ptr, sumsq_ptr, old, acc, offs_m, pid_n * BLOCK_N, in_m, N, stride_sm,
                          stride_om, stride_qm, BLOCK_N)  # fmt: skip
        else:
            store_out(out_ptr, acc, offs_m, offs_n, in_m, N, stride_om, BLOCK_M, BLOCK_N, False)


_splitk_kernel_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_splitk_kernel)
_small_m_gemm_splitk = autotune(GPU_CONFIGS, INTERPRETER_CONFIG, ("N", "K", "M_BUCKET"), _prune)(_splitk_kernel_even_k)
# the stream-feeding launches (folded norms) tune apart: their epilogue differs
_small_m_gemm_splitk_stream = autotune(GPU_CONFIGS, INTERPRETER_CONFIG, ("N", "K", "M_BUCKET"), _prune,
                                       restore_value=["stream_ptr"])(_splitk_kernel_even_k)  # in place: restored


def counters_needed(n: int) -> int:
    """The counters a launch over N output columns may use: one per column tile of the narrowest config."""
    return triton.cdiv(n, MIN_BLOCK_N)


def launch(kernel, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, counters: torch.Tensor,
           stream: torch.Tensor | None = None, sumsq: torch.Tensor | None = None, **meta) -> None:
    """Launch `kernel` (the autotuner, or the raw jit kernel with every constexpr in `meta`) from checked operands;
    with `stream`, feeding it and writing `sumsq` (see the kernel)."""
    m, k = x.shape
    n = out.shape[1]
    block_m = _block_m(m)
    ws = torch.empty(MAX_SPLIT_K * block_m * n, dtype=torch.float32, device=x.device)
    grid = lambda meta_: (triton.cdiv(n, meta_["BLOCK_N"]), meta_["SPLIT_K"])  # noqa: E731
    fold_args, fold_meta = fold_arguments(x, stream, sumsq, 0.0, scale_rows=False)
    kernel[grid](
        x, w, out, ws, counters, m, n, k, x.stride(0), w.stride(0), out.stride(0), small_m_rows_bucket(m),
        *fold_args, BLOCK_M=block_m, DOT_FP32=is_interpreter(), **{**pdl_launch_options(x.device), **fold_meta, **meta},
    )  # fmt: skip


def check_counters(counters: torch.Tensor, n: int, device: torch.device) -> None:
    """A contiguous 1-D int32 buffer on x's device with at least `counters_needed(n)` counters."""
    check_tensor(counters, "counters", ndim=1, dtypes=(torch.int32,), device=device)
    require(counters.is_contiguous(), "counters must be contiguous")
    require(counters.numel() >= counters_needed(n),
            f"counters holds {counters.numel()} counters; N = {n} needs at least {counters_needed(n)}")


def small_m_gemm_splitk(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor,
                        out: torch.Tensor | None = None, config: dict[str, int] | None = None) -> torch.Tensor:
    """out = x @ w^T with float32 sums, K split over programs and reduced in the same launch.

    Args:
        x: [M, K] bfloat16 / float16, 0 <= M <= 64, last dimension contiguous (any row stride); or float32 beside
            a half-precision w (two terms a tile, as gemm_small_m.small_m_gemm's).
        w: [N, K] in x's dtype (nn.Linear layout; half precision under a float32 x), last dimension contiguous.
        counters: [>= counters_needed(N)] int32 on x's device, all zero; zero again after the launch. Launches
            sharing a buffer must run one after another (one stream).
        out: optional [M, N] buffer in x's dtype, last dimension contiguous.
        config: a pinned launch config (SPLITK_CONFIG_KEYS: BLOCK_N, BLOCK_K, SWAP_AB, num_warps, num_stages,
            SPLIT_K) instead of autotuning, e.g. a measured table's; SPLIT_K at most MAX_SPLIT_K, BLOCK_N at
            least MIN_BLOCK_N (the counters' tile).
    Returns:
        [M, N] in x's dtype.
    Raises:
        ValueError: wrong dtype, rank, shape, layout or device, M > 64, too few counters, or a bad config.
    """
    m, n = check_gemm_operands(x, w, out, None, "w", float32_x=True)
    check_counters(counters, n, x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m and n:
        _launch_tuned_or_pinned(_small_m_gemm_splitk, x, w, out, counters, config)
    return out


def _launch_tuned_or_pinned(tuner, x, w, out, counters, config: dict[str, int] | None, **fold) -> None:
    if config is None:
        launch(tuner, x, w, out, counters, **fold)
        return
    meta = pinned_meta(config, x.shape[1], SPLITK_CONFIG_KEYS)
    require(meta["SPLIT_K"] <= MAX_SPLIT_K and meta["BLOCK_N"] >= MIN_BLOCK_N,
            f"a pinned split-K config takes SPLIT_K <= {MAX_SPLIT_K} and BLOCK_N >= {MIN_BLOCK_N}, got {config!r}")
    launch(_splitk_kernel, x, w, out, counters, **fold, **meta)


def small_m_gemm_splitk_to_stream(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor, stream: torch.Tensor,
                                  config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """stream += x @ w^T in place, K split over programs: gemm_small_m.small_m_gemm_to_stream's contract (out the
    new stream rounded to x's dtype, sumsq its sums of squares) on this kernel; counters and config as
    small_m_gemm_splitk's.

    Raises:
        ValueError: as small_m_gemm_splitk, or a stream of another shape, dtype or device.
    """
    m, n = check_gemm_operands(x, w, None, None, "w")
    check_counters(counters, n, x.device)
    check_stream(stream, m, n, x)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    sumsq = torch.empty(m, sumsq_slots(n), dtype=torch.float32, device=x.device)
    if m and n:
        _launch_tuned_or_pinned(_small_m_gemm_splitk_stream, x, w, out, counters, config, stream=stream, sumsq=sumsq)
    return out, sumsq
