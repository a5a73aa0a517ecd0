"""The bf16 / fp16 GEMM at decode batches (M <= 64): the "direct" kernel, and the same with SiLU·mul fused.

    small_m_gemm(x [M, K], w [N, K]) -> out [M, N] = x @ w^T in x's dtype, float32 sums
    small_m_gemm_silu_mul(x [M, K], w_gate_up [2I, K]) -> out [M, I] = silu(x @ w[:I]^T) * (x @ w[I:]^T)

At decode the weight read is the whole cost: Llama-3-8B's projections read 32 to 235 MB per call for
1 to 64 rows. cuBLAS splits K at these shapes and adds a reduction kernel; this kernel does what
fp8_gemm's direct kernel does for fp8 (sits.kernels.fp8_gemm, `_fp8_gemm_direct_kernel`): one launch,
no split along K. Narrow column tiles (BLOCK_N 16 to 64) give every SM about two programs at N = 4,096
and more at larger N; each program streams its [BLOCK_N, K] slice of the weight through a deep load
pipeline (`num_stages`), keeps float32 sums and writes the output dtype itself. Where the batch has
few rows the operands may swap (SWAP_AB): out^T = W x^T, so the weight rows are the tensor-core MMA's
M side instead of padding the activations to 16+ rows and using the weight as the narrow N side.

The SiLU·mul variant (the Llama MLP's gate_up projection and activation, see LlamaMLP and
sits.kernels.silu_mul: gate rows w[:I] first, up rows w[I:]) has each program stream the gate rows of
its column tile and the matching up rows as one weight tile (one pipeline; swapped, 2 x 32 rows fill a
wgmma), and write silu(gate) * up rounded as the unfused path rounds it
(each product rounded to the dtype as the GEMM stores it, silu in float32 rounded to the dtype, the
product rounded again): one launch, no [M, 2I] intermediate in memory.

The decoder norms folded into the projections (sits.runtime.models.norm_fold) use two more forms:

    small_m_gemm_to_stream(x [M, K], w [N, K], stream [M, N] float32) -> (out [M, N], sumsq [M, cdiv(N, 32)])
        stream += x @ w^T in place; out = the new stream rounded to x's dtype; sumsq = its rows' sums of
        squares over every SUMSQ_GROUP (32) columns (o_proj and down_proj feeding the residual stream)
    small_m_gemm(x, w, sumsq=sumsq, eps=eps), small_m_gemm_silu_mul(x, w, sumsq=sumsq, eps=eps)
        each row's float32 sums scaled by rsqrt(sum(sumsq[m]) / K + eps) before the epilogue (the norm of the
        stream x was rounded from, its weight already folded into w)

The row count M is not specialized (`do_not_specialize`): one binary per row tile (16, 32 or 64
rows), whatever the batch. Configs are autotuned per (N, K, bucket of M) and dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import (
    HALF_DTYPES,
    autotune,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    is_interpreter,
    length_bucket,
    require,
)
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.reference import small_m_gemm_reference, small_m_gemm_silu_mul_reference
from sits.kernels.small_m_table import CONFIG_KEYS

__all__ = [
    "MAX_M",
    "SUMSQ_GROUP",
    "small_m_gemm",
    "small_m_gemm_reference",
    "small_m_gemm_silu_mul",
    "small_m_gemm_silu_mul_reference",
    "small_m_gemm_to_stream",
    "small_m_rows_bucket",
    "sumsq_slots",
]

MAX_M = 64  # the largest row tile: one row tile covers every batch the kernel takes
SUMSQ_GROUP = 32  # columns per sum-of-squares slot that a stream-feeding launch leaves for the next norm (its
# column tiles are at least this wide)
_GROUP = tl.constexpr(SUMSQ_GROUP)  # the same, for the jit functions
# A row-scaled launch keeps its rows' sum-of-squares slots in registers across the K loop (their load hidden by the
# weight stream) up to this many values a program, else reduces them to 1 / rms first.
_EARLY_RSTD_VALUES = tl.constexpr(4096)
SMEM_BYTES = 227 * 1024  # shared memory one program may use on an H100 / H200 (sm_90)


def small_m_rows_bucket(m: int) -> int:
    """The autotune bucket of M rows (the key's M_BUCKET): M rounded up to a power of two."""
    return length_bucket(m, cap=MAX_M)


def _block_m(m: int) -> int:
    """The row tile for M rows: a power of two from 16 (tl.dot's minimum) to MAX_M."""
    return min(max(length_bucket(m), 16), MAX_M)


def _config(block_n: int, block_k: int, swap_ab: bool, warps: int, stages: int) -> triton.Config:
    """One config (BLOCK_M is not tuned: it follows M, see `_block_m`)."""
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "SWAP_AB": swap_ab},
                         num_warps=warps, num_stages=stages)


# (BLOCK_N, BLOCK_K, SWAP_AB, warps, stages). Programs at N = 4,096: 256 with 16 columns, 128 with 32;
# at N = 6,144: 384 / 192; at 28,672 (or the SiLU·mul variant's I = 14,336, twice the rows a program):
# 448 to 1,792. Wide K tiles and 3 to 8 stages keep 64 to 128 KB of weight in flight per SM; the
# 16 x 128 swapped tile keeps two programs per SM resident even at a 64-row tile (100 KB each), and the
# 4-stage 32 x 128 one fits the SiLU·mul variant's 64-row tile (its 2 x 32 weight rows: a wgmma).
# benchmarks/bench_gemm_small_m.py times each of them beside cuBLAS on the H200. The 4-warp 4-stage 64 x 128 one
# (2026-12-04) ran gate_up + SiLU·mul at 32 rows in 58.5 µs against 59.7 for the 32 x 128 the table had pinned.
GPU_CONFIGS = [
    _config(*c)
    for c in (
        (16, 512, False, 4, 4), (16, 256, False, 4, 6), (16, 256, True, 4, 5), (16, 128, True, 4, 6),
        (32, 256, True, 4, 4), (32, 128, True, 4, 8), (32, 128, True, 4, 4), (64, 256, True, 4, 3),
        (64, 128, True, 8, 5), (64, 128, True, 4, 4),
    )
]
INTERPRETER_CONFIG = _config(32, 32, False, 4, 1)


def pipeline_tiles(config: triton.Config, block_m: int, silu_mul: bool = False) -> tuple[int, int]:
    """(pipeline buffers, weight rows per tile) of a config on sm_90: the weight tile has BLOCK_N rows (2 BLOCK_N
    with SiLU·mul); the K loop keeps `stages` buffers where the dot's M side (the weight rows swapped, else
    BLOCK_M) has 64+ rows and becomes a wgmma, else stages - 1 (mma.sync)."""
    kw = config.kwargs
    w_rows = kw["BLOCK_N"] * (2 if silu_mul else 1)
    m_side = w_rows if kw["SWAP_AB"] else block_m
    return (config.num_stages if m_side >= 64 else max(config.num_stages - 1, 1)), w_rows


def shared_memory_bytes(config: triton.Config, block_m: int, silu_mul: bool = False, elem_bytes: int = 2,
                        x_bytes: int | None = None) -> int:
    """Shared memory a config's load pipeline takes on sm_90: its weight and activation tiles times the
    buffers of `pipeline_tiles`. (As Triton 3.9 allocates it for every shipped launch:
    benchmarks/compile_gemm_small_m_sm90.py.) x_bytes: the activation's element size where it is not the
    weight's (float32 activations, whose two half-precision terms are staged once more for the dots)."""
    buffers, w_rows = pipeline_tiles(config, block_m, silu_mul)
    block_k = config.kwargs["BLOCK_K"]
    if x_bytes is None or x_bytes == elem_bytes:
        return buffers * (w_rows + block_m) * block_k * elem_bytes
    return buffers * (w_rows * elem_bytes + block_m * x_bytes) * block_k + 2 * block_m * block_k * elem_bytes


def x_element_bytes(named_args: dict) -> int:
    """The activation's element size in a launch's arguments (x_ptr): 4 for float32 rows, else 2."""
    x = named_args.get("x_ptr")
    return x.element_size() if isinstance(x, torch.Tensor) else 2


def shared_memory_prune(shared_bytes, default_block_m: int):
    """An autotune prune that drops K tiles wider than K itself (mostly masked zeros) and pipelines whose
    `shared_bytes(config, block_m, silu_mul)` overflow shared memory."""

    def prune(configs, named_args, **kwargs):
        k = named_args["K"]
        block_m = kwargs.get("BLOCK_M", named_args.get("BLOCK_M", default_block_m))
        silu_mul = bool(kwargs.get("SILU_MUL", named_args.get("SILU_MUL", False)))
        x_bytes = {"x_bytes": 4} if x_element_bytes(named_args) == 4 else {}
        kept = [
            c for c in configs
            if c.kwargs["BLOCK_K"] <= max(k, 128) and shared_bytes(c, block_m, silu_mul, **x_bytes) <= SMEM_BYTES
        ]
        return kept or configs[:1]

    return prune


_prune = shared_memory_prune(shared_memory_bytes, MAX_M)


@triton.jit
def _k_mask(k, K, K_AXIS: tl.constexpr):
    """Which elements of a tile whose K indices `k` run along axis K_AXIS lie before K."""
    if K_AXIS == 0:
        mask = k[:, None] < K
    else:
        mask = k[None, :] < K
    return mask


@triton.jit
def _load_w(ptrs, k, K, EVEN_K: tl.constexpr, K_AXIS: tl.constexpr):
    """A weight tile along K (rows already clamped into range): masked past K unless every K tile is whole."""
    if EVEN_K:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=_k_mask(k, K, K_AXIS), other=0.0)
    return tile


@triton.jit
def _load_x(ptrs, row_mask, k, K, EVEN_K: tl.constexpr, K_AXIS: tl.constexpr):
    """An activation tile along K: rows past M masked (row_mask, broadcastable), and columns past K."""
    if EVEN_K:
        tile = tl.load(ptrs, mask=row_mask, other=0.0)
    else:
        tile = tl.load(ptrs, mask=row_mask & _k_mask(k, K, K_AXIS), other=0.0)
    return tile


@triton.jit
def _weight_rows(N, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr):
    """The weight rows this program streams (int64): its BLOCK_N output columns, those past N clamped to row
    N - 1 (read, never stored: each output column sums its own row only); with SILU_MUL the gate rows of those
    columns, then their up rows (N + each): 2 BLOCK_N rows. A clamp, not `% N`: a runtime modulo per element
    (an integer division's dozen dependent instructions) held the split-K kernel's first weight load back by
    some 200 instructions on sm_90a."""
    if SILU_MUL:
        r = tl.arange(0, 2 * BLOCK_N)
        rows = tl.minimum(tl.program_id(0) * BLOCK_N + r % BLOCK_N, N - 1) + (r // BLOCK_N) * N
    else:
        rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    return rows.to(tl.int64)


@triton.jit
def _dot_terms(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b for a weight tile and an activation tile (either side): a float32 activation beside a
    half-precision weight (--activation-dtype float32) enters as two terms of the weight's dtype, hi = the tile
    rounded and lo = what hi leaves, rounded (about 16 bits of its mantissa, as `mixed_linear`), each a dot with
    float32 sums. DOT_FP32 (the interpreter only, which multiplies bf16 tiles as raw bits) upcasts the tiles
    to float32 before each dot."""
    if a.dtype == tl.float32 or b.dtype == tl.float32:
        half = b.dtype if a.dtype == tl.float32 else a.dtype
        a_hi, b_hi = a.to(half), b.to(half)
        a_lo = (a - a_hi.to(tl.float32)).to(half) if a.dtype == tl.float32 else a_hi
        b_lo = (b - b_hi.to(tl.float32)).to(half) if b.dtype == tl.float32 else b_hi
        if DOT_FP32:
            a_hi, b_hi, a_lo, b_lo = a_hi.to(tl.float32), b_hi.to(tl.float32), a_lo.to(tl.float32), b_lo.to(tl.float32)
        acc = tl.dot(a_lo, b_lo, tl.dot(a_hi, b_hi, acc))
    else:
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _row_sums(x_ptr, w_ptr, rows_x, in_m, rows_w, K, stride_xm, stride_wn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """float32 sums x[rows_x] @ w[rows_w]^T over the whole K: [BLOCK_M, BLOCK_N] (BLOCK_N: rows_w's length).
    x in w's dtype, or float32 (two dots a tile, `_dot_terms`). DOT_FP32: the interpreter's upcast."""
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if SWAP_AB:  # w [BLOCK_N, BLOCK_K] and x^T [BLOCK_K, BLOCK_M], both K-major
            w = _load_w(w_ptr + rows_w[:, None] * stride_wn + k[None, :], k, K, EVEN_K, 1)
            x = _load_x(x_ptr + rows_x[None, :] * stride_xm + k[:, None], in_m[None, :], k, K, EVEN_K, 0)
            acc = _dot_terms(w, x, acc, DOT_FP32)
        else:  # x [BLOCK_M, BLOCK_K] and w^T [BLOCK_K, BLOCK_N]
            x = _load_x(x_ptr + rows_x[:, None] * stride_xm + k[None, :], in_m[:, None], k, K, EVEN_K, 1)
            w = _load_w(w_ptr + rows_w[None, :] * stride_wn + k[:, None], k, K, EVEN_K, 0)
            acc = _dot_terms(x, w, acc, DOT_FP32)
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def store_out(out_ptr, sums, offs_m, offs_n, in_m, N, stride_om,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr):  # fmt: skip
    """Write a program's [BLOCK_M, BLOCK_N] output tile in out's dtype from its float32 sums: as they are, or
    with SILU_MUL (sums [BLOCK_M, 2 BLOCK_N]: gate columns, then up) silu(gate) * up, rounded as the unfused
    GEMM + silu_mul round it (each product to the dtype, silu in float32 to the dtype, the product again)."""
    dtype = out_ptr.dtype.element_ty
    if SILU_MUL:
        gate, up = tl.split(tl.permute(tl.reshape(sums, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
        gate = gate.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * up.to(dtype).to(tl.float32)
    else:
        acc = sums
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(dtype), mask=in_m[:, None] & (offs_n[None, :] < N))


@triton.jit
def load_stream_tile(stream_ptr, offs_m, col0, in_m, N, stride_sm, BLOCK_N: tl.constexpr):
    """The float32 stream's [BLOCK_M, BLOCK_N] tile at columns col0 + [0, BLOCK_N) (0 past M and N): loaded before
    the weight stream, so that `add_to_stream` waits for no load. Only this launch's `add_to_stream` of the same
    tile writes it, after every program of the tile has loaded it."""
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask = in_m[:, None] & (offs_n[None, :] < N)
    return tl.load(stream_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_n[None, :], mask=mask, other=0.0)


@triton.jit
def add_to_stream(stream_ptr, out_ptr, sumsq_ptr, old, sums, offs_m, col0, in_m, N, stride_sm, stride_om, stride_qm,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """The epilogue of a launch that feeds the residual stream (o_proj, down_proj with folded norms): the
    program's float32 sums [BLOCK_M, BLOCK_N] (columns col0 + [0, BLOCK_N); col0 and BLOCK_N multiples of
    SUMSQ_GROUP) are added to the float32 stream tile `old` (`load_stream_tile`) and stored back in place, the
    new stream rounded to out's dtype is written to out (the next projection's input), and each row's sum of
    squares over each SUMSQ_GROUP columns to sumsq [M, cdiv(N, SUMSQ_GROUP)] float32 (the next norm's mean of
    squares, `row_rstd`)."""
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask = in_m[:, None] & (offs_n[None, :] < N)
    rows = offs_m[:, None].to(tl.int64)
    new = old + sums
    tl.store(stream_ptr + rows * stride_sm + offs_n[None, :], new, mask=mask)
    tl.store(out_ptr + rows * stride_om + offs_n[None, :], new.to(out_ptr.dtype.element_ty), mask=mask)
    squares = tl.where(mask, new * new, 0.0)
    groups = tl.sum(tl.reshape(squares, [squares.shape[0], BLOCK_N // _GROUP, _GROUP]), axis=2)
    offs_g = col0 // _GROUP + tl.arange(0, BLOCK_N // _GROUP)
    g_mask = in_m[:, None] & (offs_g[None, :] < tl.cdiv(N, _GROUP))
    tl.store(sumsq_ptr + rows * stride_qm + offs_g[None, :], groups, mask=g_mask)


@triton.jit
def load_row_squares(sumsq_ptr, offs_m, in_m, stride_qm, K, RSTD_SLOTS: tl.constexpr):
    """The sums of squares `add_to_stream` left for these rows: [BLOCK_M, RSTD_SLOTS] float32 (slots past
    cdiv(K, SUMSQ_GROUP) and rows past M are 0)."""
    offs_g = tl.arange(0, RSTD_SLOTS)
    mask = in_m[:, None] & (offs_g[None, :] < tl.cdiv(K, _GROUP))
    return tl.load(sumsq_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_g[None, :], mask=mask, other=0.0)


@triton.jit
def row_rstd(squares, K, eps):
    """1 / rms of each row from its slots' sums of squares [BLOCK_M, slots]: rsqrt(sum / K + eps), [BLOCK_M]."""
    return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary per row tile, not per batch size
def _small_m_gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, M_BUCKET,
    stream_ptr, sumsq_ptr, stride_sm, stride_qm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, USE_PDL: tl.constexpr = False,
    STREAM: tl.constexpr = False, RSTD_SLOTS: tl.constexpr = 0,
):  # fmt: skip
    """out [M, N] in out's dtype; grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)).

    Plain: out = x @ w^T, w [N, K]. SILU_MUL: w is [2N, K] (gate rows [0, N), up rows [N, 2N)) and
    out = silu(x @ w[:N]^T) * (x @ w[N:]^T), rounded as the unfused GEMM + silu_mul round it.
    Each program sums the whole K for one [BLOCK_M, BLOCK_N] tile; with SILU_MUL its weight tile holds
    the gate rows and then the up rows of its columns (2 BLOCK_N rows, one load pipeline, one dot per
    K tile), split apart in the epilogue. Columns past N load row N - 1 and are masked at the
    store; activation rows past M are masked at the load (a batch of 1 to 15 rows in a 16-row tile
    reads only its rows). USE_PDL: launched with programmatic dependent launch (sits.kernels.pdl).

    Folded decoder norms (see `small_m_gemm_to_stream`, `small_m_gemm`'s sumsq): RSTD_SLOTS > 0 scales each
    row's sums by rsqrt(mean square + eps), the mean square from sumsq [M, cdiv(K, SUMSQ_GROUP)] (RSTD_SLOTS:
    that width's next power of two); STREAM adds the sums to the float32 stream [M, N] in place and writes
    the new stream rounded to out, and its sums of squares to sumsq (`add_to_stream`; not with SILU_MUL).
    """
    pdl_wait(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_x = offs_m.to(tl.int64)
    in_m = offs_m < M
    rows_w = _weight_rows(N, BLOCK_N, SILU_MUL)
    if STREAM:
        old = load_stream_tile(stream_ptr, offs_m, tl.program_id(0) * BLOCK_N, in_m, N, stride_sm, BLOCK_N)
    if RSTD_SLOTS:  # loaded before the weight stream; reduced after it unless that holds too many registers
        squares = load_row_squares(sumsq_ptr, offs_m, in_m, stride_qm, K, RSTD_SLOTS)
        if BLOCK_M * RSTD_SLOTS > _EARLY_RSTD_VALUES:
            rstd = row_rstd(squares, K, eps)
    if SILU_MUL:
        sums = _row_sums(x_ptr, w_ptr, rows_x, in_m, rows_w, K, stride_xm, stride_wn,
                         BLOCK_M, 2 * BLOCK_N, BLOCK_K, SWAP_AB, EVEN_K, DOT_FP32)  # fmt: skip
    else:
        sums = _row_sums(x_ptr, w_ptr, rows_x, in_m, rows_w, K, stride_xm, stride_wn,
                         BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, EVEN_K, DOT_FP32)  # fmt: skip
    if RSTD_SLOTS:
        if BLOCK_M * RSTD_SLOTS <= _EARLY_RSTD_VALUES:
            rstd = row_rstd(squares, K, eps)
        sums = sums * rstd[:, None]
    if STREAM:
        add_to_stream(stream_ptr, out_ptr, sumsq_ptr, old, sums, offs_m, tl.program_id(0) * BLOCK_N, in_m, N,
                      stride_sm, stride_om, stride_qm, BLOCK_N)  # fmt: skip
    else:
        store_out(out_ptr, sums, offs_m, offs_n, in_m, N, stride_om, BLOCK_M, BLOCK_N, SILU_MUL)


_small_m_gemm_kernel_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(
    _small_m_gemm_kernel
)
_KEY = ("N", "K", "M_BUCKET")
# Tuners over the same kernel, one per variant: the plain GEMM and the SiLU·mul variant pick configs apart (their
# N means different things, and the variant streams twice the weight rows per program), and so do the folded
# norms' row-scaled and stream-feeding launches (their epilogues differ).
_small_m_gemm = autotune(GPU_CONFIGS, INTERPRETER_CONFIG, _KEY, _prune)(_small_m_gemm_kernel_even_k)
_small_m_gemm_silu = autotune(GPU_CONFIGS, INTERPRETER_CONFIG, _KEY, _prune)(_small_m_gemm_kernel_even_k)
_small_m_gemm_rstd = autotune(GPU_CONFIGS, INTERPRETER_CONFIG, _KEY, _prune)(_small_m_gemm_kernel_even_k)
_small_m_gemm_silu_rstd = autotune(GPU_CONFIGS, INTERPRETER_CONFIG, _KEY, _prune)(_small_m_gemm_kernel_even_k)


def _prune_stream(configs, named_args, **kwargs):
    """`_prune`, less the column tiles narrower than a sum-of-squares slot."""
    return _prune([c for c in configs if c.kwargs["BLOCK_N"] >= SUMSQ_GROUP], named_args, **kwargs)


# the stream is updated in place: each timed run gets it back
_small_m_gemm_stream = autotune(GPU_CONFIGS, INTERPRETER_CONFIG, _KEY, _prune_stream, restore_value=["stream_ptr"])(
    _small_m_gemm_kernel_even_k)


def sumsq_slots(n: int) -> int:
    """Columns of the sums of squares a stream-feeding launch over n columns leaves: cdiv(n, SUMSQ_GROUP)."""
    return triton.cdiv(n, SUMSQ_GROUP)


def fold_arguments(x: torch.Tensor, stream: torch.Tensor | None, sumsq: torch.Tensor | None, eps: float,
                   scale_rows: bool) -> tuple[tuple, dict]:
    """The folded-norm arguments of a small-M launch: (stream_ptr, sumsq_ptr, stride_sm, stride_qm, eps) and the
    STREAM / RSTD_SLOTS constexprs. x stands in for a pointer the launch does not read (same alignment)."""
    args = (x if stream is None else stream, x if sumsq is None else sumsq,
            0 if stream is None else stream.stride(0), 0 if sumsq is None else sumsq.stride(0), float(eps))
    slots = triton.next_power_of_2(sumsq.shape[1]) if scale_rows and sumsq is not None else 0
    return args, {"STREAM": stream is not None, "RSTD_SLOTS": slots}


def launch(kernel, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, silu_mul: bool,
           stream: torch.Tensor | None = None, sumsq: torch.Tensor | None = None, eps: float = 0.0, **meta) -> None:
    """Launch `kernel` (an autotuner above, or the raw jit kernel with every constexpr in `meta`) writing
    out [M, N'] (N' = N, or I = N / 2 with silu_mul) from checked operands; with `stream`, feeding it (and
    writing `sumsq`), else with `sumsq`, scaling rows by it (see the kernel)."""
    m, k = x.shape
    n = out.shape[1]
    block_m = _block_m(m)
    grid = lambda meta_: (triton.cdiv(n, meta_["BLOCK_N"]), triton.cdiv(m, block_m))  # noqa: E731
    fold_args, fold_meta = fold_arguments(x, stream, sumsq, eps, scale_rows=stream is None)
    kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), small_m_rows_bucket(m), *fold_args,
        BLOCK_M=block_m, SILU_MUL=silu_mul, DOT_FP32=is_interpreter(),
        **{**pdl_launch_options(x.device), **fold_meta, **meta},
    )  # fmt: skip


def pinned_meta(config: dict[str, int], k: int, keys: tuple[str, ...]) -> dict:
    """A pinned config (a measured table's, sits.kernels.small_m_table) as the raw kernel's launch keywords:
    exactly `keys`, SWAP_AB as a bool, EVEN_K from K. Raises ValueError on other keys."""
    require(isinstance(config, dict) and set(config) == set(keys),
            f"a pinned config has exactly {', '.join(keys)}, got {config!r}")
    meta = {key: int(value) for key, value in config.items()}
    meta["SWAP_AB"] = bool(meta["SWAP_AB"])
    meta["EVEN_K"] = k % meta["BLOCK_K"] == 0
    return meta


def check_gemm_operands(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, out_cols: int | None,
                        name: str, float32_x: bool = False) -> tuple[int, int]:
    """The operand checks of every small-M entry point (x [M, K] half, or float32 where the entry point takes
    float32 activations (`float32_x`); `name` [rows, K] half, x's dtype unless x is float32; out [M, out_cols or
    rows] in x's dtype): raises ValueError, else returns (M, output columns)."""
    check_tensor(x, "x", ndim=2, dtypes=(*HALF_DTYPES, torch.float32) if float32_x else HALF_DTYPES)
    check_tensor(w, name, ndim=2, dtypes=HALF_DTYPES if x.dtype == torch.float32 else (x.dtype,), device=x.device)
    m, k = x.shape
    require(w.shape[1] == k, f"x is [M, {k}] but {name} is {tuple(w.shape)}; expected [rows, {k}]")
    require(k > 0, "K must be positive")
    require(m <= MAX_M, f"the small-M GEMM takes at most {MAX_M} rows, got M = {m}")
    check_inner_contiguous(x, "x")
    check_inner_contiguous(w, name)
    cols = w.shape[0] if out_cols is None else out_cols
    if out is not None:
        check_tensor(out, "out", dtypes=(x.dtype,), device=x.device)
        check_shape(out, "out", (m, cols))
        check_inner_contiguous(out, "out")
    return m, cols


def check_row_squares(sumsq: torch.Tensor, m: int, cols: int, x: torch.Tensor) -> None:
    """sumsq: [m, sumsq_slots(cols)] float32 on x's device, last dimension contiguous (ValueError otherwise)."""
    check_tensor(sumsq, "sumsq", ndim=2, dtypes=(torch.float32,), device=x.device)
    check_shape(sumsq, "sumsq", (m, sumsq_slots(cols)))
    check_inner_contiguous(sumsq, "sumsq")


def small_m_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                 config: dict[str, int] | None = None, sumsq: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
    """out = x @ w^T with float32 sums, for decode batches.

    Args:
        x: [M, K] bfloat16 / float16 activations, 0 <= M <= MAX_M (64), last dimension contiguous
            (any row stride); or float32 beside a half-precision w (--activation-dtype float32, not with sumsq):
            each x tile then enters as two terms of w's dtype, hi + lo, two dots with float32 sums.
        w: [N, K] weight in x's dtype (nn.Linear layout; half precision under a float32 x), last dimension
            contiguous.
        out: optional [M, N] buffer in x's dtype, last dimension contiguous.
        config: a pinned launch config (CONFIG_KEYS: BLOCK_N, BLOCK_K, SWAP_AB, num_warps, num_stages) instead
            of autotuning, e.g. a measured table's.
        sumsq: optional [M, sumsq_slots(K)] float32, the sums of squares of the stream x was rounded from
            (`small_m_gemm_to_stream`): each output row is then scaled by rsqrt(sum(sumsq[m]) / K + eps), so
            that with the norm weight folded into w the launch is the decoder norm and the projection.
        eps: the norm's epsilon (with sumsq).
    Returns:
        [M, N] in x's dtype.
    Raises:
        ValueError: wrong dtype, rank, shape, layout or device, M > MAX_M, or a config with other keys.
    """
    m, n = check_gemm_operands(x, w, out, None, "w", float32_x=sumsq is None)
    if sumsq is not None:
        check_row_squares(sumsq, m, x.shape[1], x)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m and n:
        tuner = _small_m_gemm if sumsq is None else _small_m_gemm_rstd
        _launch_tuned_or_pinned(tuner, x, w, out, False, config, sumsq=sumsq, eps=eps)
    return out


def _launch_tuned_or_pinned(tuner, x, w, out, silu_mul: bool, config: dict[str, int] | None, **fold) -> None:
    if config is None:
        launch(tuner, x, w, out, silu_mul, **fold)
    else:
        launch(_small_m_gemm_kernel, x, w, out, silu_mul, **fold, **pinned_meta(config, x.shape[1], CONFIG_KEYS))


def small_m_gemm_silu_mul(x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor | None = None,
                          config: dict[str, int] | None = None, sumsq: torch.Tensor | None = None,
                          eps: float = 0.0) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T), the gate_up GEMM and SiLU·mul in one launch.

    Args:
        x: [M, K] bfloat16 / float16, 0 <= M <= MAX_M (64), last dimension contiguous; or float32 beside a
            half-precision w_gate_up (not with sumsq), as small_m_gemm's, the SiLU·mul then in float32 unrounded.
        w_gate_up: [2I, K] in x's dtype (half precision under a float32 x): gate rows [0, I), up rows [I, 2I)
            (LlamaMLP's gate_up_proj).
        out: optional [M, I] buffer in x's dtype, last dimension contiguous.
        config: a pinned launch config, as small_m_gemm's.
        sumsq, eps: as small_m_gemm's (the products scaled before the activation).
    Returns:
        [M, I] in x's dtype: the unfused silu_mul(x @ w_gate_up^T), each step rounded as it rounds.
    Raises:
        ValueError: as small_m_gemm, or an odd number of weight rows.
    """
    rows = w_gate_up.shape[0] if isinstance(w_gate_up, torch.Tensor) and w_gate_up.dim() == 2 else 1
    require(rows % 2 == 0, f"w_gate_up must have an even number of rows (gate, then up), got {rows}")
    m, cols = check_gemm_operands(x, w_gate_up, out, rows // 2, "w_gate_up", float32_x=sumsq is None)
    if sumsq is not None:
        check_row_squares(sumsq, m, x.shape[1], x)
    out = torch.empty(m, cols, dtype=x.dtype, device=x.device) if out is None else out
    if m and cols:
        tuner = _small_m_gemm_silu if sumsq is None else _small_m_gemm_silu_rstd
        _launch_tuned_or_pinned(tuner, x, w_gate_up, out, True, config, sumsq=sumsq, eps=eps)
    return out


def check_stream(stream: torch.Tensor, m: int, n: int, x: torch.Tensor) -> None:
    """stream: [m, n] float32 on x's device, last dimension contiguous (ValueError otherwise)."""
    check_tensor(stream, "stream", ndim=2, dtypes=(torch.float32,), device=x.device)
    check_shape(stream, "stream", (m, n))
    check_inner_contiguous(stream, "stream")


def small_m_gemm_to_stream(x: torch.Tensor, w: torch.Tensor, stream: torch.Tensor,
                           config: dict[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """stream += x @ w^T (float32 sums, in place), for a projection that feeds the residual stream (o_proj,
    down_proj) when the next decoder norm is folded into the projection after it.

    Args:
        x, w, config: as small_m_gemm's (N = w's rows).
        stream: [M, N] float32, the residual stream, updated in place.
    Returns:
        (out [M, N] the new stream rounded to x's dtype, the next projection's input; sumsq
        [M, sumsq_slots(N)] float32, the new stream's sums of squares over each SUMSQ_GROUP columns, which
        small_m_gemm(out, ..., sumsq=sumsq) turns into the norm's 1 / rms).
    Raises:
        ValueError: as small_m_gemm, or a stream of another shape, dtype or device.
    """
    m, n = check_gemm_operands(x, w, None, None, "w")
    check_stream(stream, m, n, x)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    sumsq = torch.empty(m, sumsq_slots(n), dtype=torch.float32, device=x.device)
    if config is not None:
        require(config.get("BLOCK_N", 0) >= SUMSQ_GROUP,
                f"a stream-feeding launch takes column tiles of at least {SUMSQ_GROUP}, got {config!r}")
    if m and n:
        _launch_tuned_or_pinned(_small_m_gemm_stream, x, w, out, False, config, stream=stream, sumsq=sumsq)
    return out, sumsq
