"""RMSNorm (with the residual add) fused into the small-M direct GEMM's prologue: one launch for a decoder's
norm and the projection it feeds, at the smallest decode batches (M <= 8).

    small_m_norm_gemm(x [M, K], residual [M, K] | None, norm_weight [K], eps, w [N, K])
        -> (out [M, N] = rmsnorm(residual + x) * norm_weight @ w^T, residual_new [M, K])
    small_m_norm_gemm_silu_mul(x, residual, norm_weight, eps, w_gate_up [2I, K])
        -> (out [M, I] = silu(normed @ gate^T) * (normed @ up^T), residual_new)

A Llama layer's two norms (input_layernorm before qkv_proj, post_attention_layernorm before gate_up_proj)
add the previous sublayer's output x to the float32 residual stream and normalize the sum
(sits.kernels.rmsnorm). At batch 1 that norm reads 4,096 elements: its ~2.5 µs are launch latency. Here
each program of the direct GEMM (sits.kernels.gemm_small_m) does the norm itself:

1. the first pass reads each of its rows of x and residual (from L2 after the first program) and sums the
   squares of residual + x over the whole row, as the norm kernel does (one reduction over a power-of-two
   block of the row): the rows' 1 / rms;
2. the GEMM's K loop loads x and residual tiles instead of a normalized activation tile and builds it on
   the fly, rounded as the norm kernel rounds it: the sum rounded to the stream's dtype, times 1 / rms
   rounded to the model dtype, times the norm weight rounded again; the rest is the direct kernel;
3. the first column tile's programs (pid (0, j)) also write residual_new, the rounded sum: exactly one
   program writes each row. residual_new is a buffer of its own, never `residual`: the other programs
   still read the old stream.

Without a residual (a decoder's first norm starts the stream from the embedding rows) the sum is x
itself, written to residual_new in the stream's dtype (`stream_dtype`), or not written at all when the
stream keeps x's dtype (residual_new is x). `normed` matches sits.kernels.rmsnorm.rms_norm bit for bit
(under Triton's interpreter, where both reduce a row the same way; on a GPU the reduction order may differ
in the last bit of 1 / rms), so out matches rms_norm then small_m_gemm (or small_m_gemm_silu_mul).

Every program re-reads its rows: M x K x (2 + 4) bytes (x and the float32 stream) twice, from L2, per
program (384 programs at N = 6,144 with 16 columns each). Hence M <= NORM_MAX_M (8): past that the
separate norm costs less than the re-reads; the measured table (sits.kernels.small_m_table, ops
"norm_linear" and "norm_silu_mul") says where the fused form wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.gemm_small_m import (
    GPU_CONFIGS,
    INTERPRETER_CONFIG,
    _block_m,
    _k_mask,
    _load_w,
    _weight_rows,
    check_gemm_operands,
    pipeline_tiles,
    shared_memory_prune,
    small_m_rows_bucket,
    store_out,
)
from sits.kernels.launch_utils import (
    FLOAT_DTYPES,
    HALF_DTYPES,
    autotune,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    is_interpreter,
    next_power_of_2,
    require,
)
from sits.kernels.reference import small_m_norm_gemm_reference, small_m_norm_gemm_silu_mul_reference

__all__ = [
    "NORM_GPU_CONFIGS",
    "NORM_MAX_K",
    "NORM_MAX_M",
    "small_m_norm_gemm",
    "small_m_norm_gemm_reference",
    "small_m_norm_gemm_silu_mul",
    "small_m_norm_gemm_silu_mul_reference",
]

NORM_MAX_M = 8  # every program re-reads its rows: only worth it at the smallest batches
NORM_MAX_K = 16384  # the first pass holds a whole row (a power of two >= K) in one program's registers
STREAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The direct kernel's configs but its 512-wide K tile: with the x and stream tiles built in registers beside
# the weight tile it runs out of registers (255, spilling; benchmarks/compile_gemm_small_m_norm_sm90.py).
NORM_GPU_CONFIGS = [c for c in GPU_CONFIGS if c.kwargs["BLOCK_K"] <= 256]


def shared_memory_bytes(config: triton.Config, block_m: int, silu_mul: bool = False) -> int:
    """Shared memory bound of a config's K loop on sm_90: per pipeline buffer (`pipeline_tiles`) the weight
    tile (bf16), the x tile (2 bytes an element), the float32 stream tile (4) and the norm weight's K tile (2)."""
    buffers, w_rows = pipeline_tiles(config, block_m, silu_mul)
    return buffers * (w_rows * 2 + block_m * 6 + 2) * config.kwargs["BLOCK_K"]


_prune = shared_memory_prune(shared_memory_bytes, 16)


@triton.jit
def _stream_values(x_ptrs, res_ptrs, mask, res_out_ptr, HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr):
    """float32 values of the stream after the add: x + residual (or x) rounded to the stream's dtype
    (res_out_ptr's) where it is written, as sits.kernels.rmsnorm rounds it before normalizing."""
    v = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if WRITE_RESIDUAL:
        if HAS_RESIDUAL:
            v = v + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        v = v.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    return v


@triton.jit
def _rows_rstd(x_ptr, res_ptr, res_out_ptr, M, K, stride_xm, stride_rm, stride_rom, eps,
               BLOCK_M: tl.constexpr, ROW_BLOCK: tl.constexpr,
               HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr):  # fmt: skip
    """[BLOCK_M] float32 1 / rms of this program's rows (0 past M), each row reduced in one block of
    ROW_BLOCK (>= K) as the norm kernel reduces it; the first column tile's programs write the rounded
    stream rows to res_out."""
    cols = tl.arange(0, ROW_BLOCK)
    in_k = cols < K
    in_write = cols < tl.where(tl.program_id(0) == 0, K, 0)  # the whole row in column tile 0, else nothing
    first = tl.program_id(1) * BLOCK_M
    slots = tl.arange(0, BLOCK_M)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i in range(0, tl.minimum(M - first, BLOCK_M)):
        row = (first + i).to(tl.int64)
        s = _stream_values(x_ptr + row * stride_xm + cols, res_ptr + row * stride_rm + cols, in_k, res_out_ptr,
                           HAS_RESIDUAL, WRITE_RESIDUAL)  # fmt: skip
        if WRITE_RESIDUAL:
            tl.store(res_out_ptr + row * stride_rom + cols, s.to(res_out_ptr.dtype.element_ty), mask=in_write)
        mean_square = tl.sum(s * s, axis=0) / K
        rstd = tl.where(slots == i, tl.rsqrt(mean_square + eps), rstd)
    return rstd


@triton.jit
def _normed_tile(x_ptr, res_ptr, nw_ptr, res_out_ptr, rows, row_mask, rstd, k, K, stride_xm, stride_rm,
                 K_AXIS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr):  # fmt: skip
    """The normalized activation tile in x's dtype, its K indices `k` along axis K_AXIS (rows and rstd
    along the other): rmsnorm's rounding, (stream * rstd) to the dtype, times the norm weight, to the
    dtype again. Rows past M and columns past K are 0."""
    dtype = x_ptr.dtype.element_ty
    mask = row_mask & _k_mask(k, K, K_AXIS)
    if K_AXIS == 0:  # [BLOCK_K, BLOCK_M]
        s = _stream_values(x_ptr + rows[None, :] * stride_xm + k[:, None], res_ptr + rows[None, :] * stride_rm
                           + k[:, None], mask, res_out_ptr, HAS_RESIDUAL, WRITE_RESIDUAL)  # fmt: skip
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)[:, None]
        normed = (s * rstd[None, :]).to(dtype).to(tl.float32)
    else:  # [BLOCK_M, BLOCK_K]
        s = _stream_values(x_ptr + rows[:, None] * stride_xm + k[None, :], res_ptr + rows[:, None] * stride_rm
                           + k[None, :], mask, res_out_ptr, HAS_RESIDUAL, WRITE_RESIDUAL)  # fmt: skip
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
        normed = (s * rstd[:, None]).to(dtype).to(tl.float32)
    return (normed * nw).to(dtype)


@triton.jit
def _zero_sums(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, SILU_MUL: tl.constexpr):
    """The float32 sums of one program at 0: [rows, BLOCK_M] swapped, else [BLOCK_M, rows]; rows = its weight
    rows (BLOCK_N, or 2 BLOCK_N with SILU_MUL)."""
    if SILU_MUL:
        if SWAP_AB:
            acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    else:
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary per row tile, not per batch size
def _small_m_norm_gemm_kernel(
    x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, res_out_ptr, M, N, K, stride_xm, stride_rm, stride_rom, stride_wn,
    stride_om, eps, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, ROW_BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, WRITE_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """out [M, N] (or [M, N] of SiLU·mul products from w [2N, K]) of the normalized rows; grid
    (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)). HAS_RESIDUAL: stream = x + residual; WRITE_RESIDUAL: the stream,
    rounded to res_out's dtype, goes to res_out (by the programs of column tile 0) and is what is
    normalized; neither: x itself is normalized. See gemm_small_m._small_m_gemm_kernel for the GEMM."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_x = offs_m.to(tl.int64)
    in_m = offs_m < M
    rstd = _rows_rstd(x_ptr, res_ptr, res_out_ptr, M, K, stride_xm, stride_rm, stride_rom, eps,
                      BLOCK_M, ROW_BLOCK, HAS_RESIDUAL, WRITE_RESIDUAL)  # fmt: skip
    rows_w = _weight_rows(N, BLOCK_N, SILU_MUL)
    offs_k = tl.arange(0, BLOCK_K)
    acc = _zero_sums(BLOCK_M, BLOCK_N, SWAP_AB, SILU_MUL)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if SWAP_AB:  # w [rows_n, BLOCK_K] and the normed x^T [BLOCK_K, BLOCK_M]
            w = _load_w(w_ptr + rows_w[:, None] * stride_wn + k[None, :], k, K, EVEN_K, 1)
            a = _normed_tile(x_ptr, res_ptr, nw_ptr, res_out_ptr, rows_x, in_m[None, :], rstd, k, K, stride_xm,
                             stride_rm, 0, HAS_RESIDUAL, WRITE_RESIDUAL)  # fmt: skip
            if DOT_FP32:
                w, a = w.to(tl.float32), a.to(tl.float32)
            acc = tl.dot(w, a, acc)
        else:  # the normed x [BLOCK_M, BLOCK_K] and w^T [BLOCK_K, rows_n]
            a = _normed_tile(x_ptr, res_ptr, nw_ptr, res_out_ptr, rows_x, in_m[:, None], rstd, k, K, stride_xm,
                             stride_rm, 1, HAS_RESIDUAL, WRITE_RESIDUAL)  # fmt: skip
            w = _load_w(w_ptr + rows_w[None, :] * stride_wn + k[:, None], k, K, EVEN_K, 0)
            if DOT_FP32:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    store_out(out_ptr, acc, offs_m, offs_n, in_m, N, stride_om, BLOCK_M, BLOCK_N, SILU_MUL)


_small_m_norm_gemm_kernel_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(
    _small_m_norm_gemm_kernel
)
# The layer-0 variant (no residual) and the rest tune apart; res_out never aliases an input, so the timed
# runs of a new key may write it again and again.
_KEY = ("N", "K", "M_BUCKET", "HAS_RESIDUAL", "WRITE_RESIDUAL")
_norm_gemm = autotune(NORM_GPU_CONFIGS, INTERPRETER_CONFIG, _KEY, _prune)(_small_m_norm_gemm_kernel_even_k)
_norm_gemm_silu = autotune(NORM_GPU_CONFIGS, INTERPRETER_CONFIG, _KEY, _prune)(_small_m_norm_gemm_kernel_even_k)


def launch(kernel, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
           w: torch.Tensor, out: torch.Tensor, residual_out: torch.Tensor | None, silu_mul: bool, **meta) -> None:
    """Launch `kernel` (an autotuner above, or the raw jit kernel with every GEMM constexpr in `meta`) on
    checked operands: out [M, N'] (N' = N, or N / 2 with silu_mul), residual_out [M, K] or None (no write)."""
    m, k = x.shape
    n = out.shape[1]
    block_m = _block_m(m)
    res = x if residual is None else residual  # unused without HAS_RESIDUAL
    res_out = x if residual_out is None else residual_out  # unused without WRITE_RESIDUAL
    grid = lambda meta_: (triton.cdiv(n, meta_["BLOCK_N"]), triton.cdiv(m, block_m))  # noqa: E731
    kernel[grid](
        x, res, norm_weight, w, out, res_out, m, n, k, x.stride(0), res.stride(0), res_out.stride(0), w.stride(0),
        out.stride(0), float(eps), small_m_rows_bucket(m),
        BLOCK_M=block_m, SILU_MUL=silu_mul, DOT_FP32=is_interpreter(), ROW_BLOCK=next_power_of_2(k),
        HAS_RESIDUAL=residual is not None, WRITE_RESIDUAL=residual_out is not None, **meta,
    )  # fmt: skip


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range [start, end) a tensor's elements occupy."""
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + (extent * t.element_size() if t.numel() else 0)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' element ranges share a byte."""
    (a_start, a_end), (b_start, b_end) = _span(a), _span(b)
    return a_start < b_end and b_start < a_end


def _check_stream(x: torch.Tensor, residual: torch.Tensor | None, stream_dtype: torch.dtype | None,
                  residual_out: torch.Tensor | None) -> torch.dtype | None:
    """Check the stream's operands; returns the dtype residual_new is written in (None: not written, it is x)."""
    if residual is not None:
        check_tensor(residual, "residual", ndim=2, dtypes=STREAM_DTYPES, device=x.device)
        check_shape(residual, "residual", tuple(x.shape))
        check_inner_contiguous(residual, "residual")
        require(stream_dtype in (None, residual.dtype), f"stream_dtype {stream_dtype} differs from the "
                f"residual's {residual.dtype}")
        dtype: torch.dtype | None = residual.dtype
    else:
        require(stream_dtype is None or stream_dtype in STREAM_DTYPES,
                f"stream_dtype must be one of {STREAM_DTYPES}, got {stream_dtype}")
        dtype = None if stream_dtype in (None, x.dtype) else stream_dtype
    if residual_out is not None:
        require(dtype is not None, "residual_out is given but nothing is written (no residual, and the stream "
                "keeps x's dtype)")
        check_tensor(residual_out, "residual_out", dtypes=(dtype,), device=x.device)
        check_shape(residual_out, "residual_out", tuple(x.shape))
        check_inner_contiguous(residual_out, "residual_out")
        for name, source in (("x", x), ("residual", residual)):
            require(source is None or not _overlaps(residual_out, source),
                    f"residual_out must not overlap {name}: the other programs still read it")
    return dtype


def _check(x, residual, norm_weight, eps, w, out, out_cols, stream_dtype, residual_out, name):
    """Checks shared by both entry points; returns (M, output columns, residual_new's dtype or None)."""
    check_tensor(x, "x", ndim=2, dtypes=HALF_DTYPES)
    m, k = x.shape
    require(0 < k <= NORM_MAX_K, f"K must be in 1..{NORM_MAX_K}, got {k}")
    require(m <= NORM_MAX_M, f"the fused norm + small-M GEMM takes at most {NORM_MAX_M} rows, got M = {m}")
    check_tensor(norm_weight, "norm_weight", ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape(norm_weight, "norm_weight", (k,))
    require(norm_weight.is_contiguous(), "norm_weight must be contiguous")
    require(isinstance(eps, (int, float)) and eps >= 0, f"eps must be a non-negative number, got {eps!r}")
    m, cols = check_gemm_operands(x, w, out, out_cols, name)
    return m, cols, _check_stream(x, residual, stream_dtype, residual_out)


def _run(tuner, x, residual, norm_weight, eps, w, out, cols, stream_dtype, residual_out, silu_mul):
    m, k = x.shape
    out = torch.empty(m, cols, dtype=x.dtype, device=x.device) if out is None else out
    if stream_dtype is not None and residual_out is None:
        residual_out = torch.empty(m, k, dtype=stream_dtype, device=x.device)
    if m and cols:
        launch(tuner, x, residual, norm_weight, eps, w, out, residual_out, silu_mul)
    elif m and residual_out is not None:  # no output column: the stream still moves on
        summed = x.to(residual_out.dtype) if residual is None else residual + x.to(residual.dtype)
        residual_out.copy_(summed)
    return out, x if residual_out is None else residual_out


def small_m_norm_gemm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      w: torch.Tensor, *, stream_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The add + RMSNorm of a decoder's residual stream and the projection it feeds, in one launch.

    Args:
        x: [M, K] bfloat16 / float16, the previous sublayer's output (or the embedding rows when residual is
            None), 0 <= M <= NORM_MAX_M (8), 1 <= K <= NORM_MAX_K, last dimension contiguous.
        residual: [M, K] the stream (float32, float16 or bfloat16), last dimension contiguous; None: x
            starts the stream.
        norm_weight: [K] the norm's scale, any float dtype, contiguous.
        eps: added to the mean of squares.
        w: [N, K] projection weight in x's dtype, last dimension contiguous.
        stream_dtype: without residual, the stream's dtype (None or x's dtype: the stream is x, nothing is
            written); with residual, None or residual's dtype.
        out: optional [M, N] buffer in x's dtype, last dimension contiguous.
        residual_out: optional [M, K] buffer for residual_new in the stream's dtype; must not overlap x or
            residual (the kernel's other programs read them while it is written).
    Returns:
        (out [M, N] in x's dtype = normed @ w^T with float32 sums, residual_new [M, K]): normed =
        rmsnorm(stream) * norm_weight in x's dtype exactly as sits.kernels.rmsnorm.rms_norm computes it, the
        stream = residual + x rounded to residual's dtype (or x in stream_dtype; or x itself).
    Raises:
        ValueError: wrong dtype, rank, shape, layout or device, M > NORM_MAX_M, K > NORM_MAX_K, a negative
            eps, or residual_out overlapping an input.
    """
    m, cols, dtype = _check(x, residual, norm_weight, eps, w, out, None, stream_dtype, residual_out, "w")
    return _run(_norm_gemm, x, residual, norm_weight, eps, w, out, cols, dtype, residual_out, False)


def small_m_norm_gemm_silu_mul(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                               eps: float, w_gate_up: torch.Tensor, *, stream_dtype: torch.dtype | None = None,
                               out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """small_m_norm_gemm with the gate_up projection and SiLU·mul (small_m_gemm_silu_mul) as the GEMM.

    Args:
        x, residual, norm_weight, eps, stream_dtype, residual_out: as small_m_norm_gemm.
        w_gate_up: [2I, K] in x's dtype: gate rows [0, I), up rows [I, 2I) (LlamaMLP's gate_up_proj).
        out: optional [M, I] buffer in x's dtype, last dimension contiguous.
    Returns:
        (out [M, I] = silu(normed @ gate^T) * (normed @ up^T) rounded as the unfused path rounds it,
        residual_new [M, K]).
    Raises:
        ValueError: as small_m_norm_gemm, or an odd number of weight rows.
    """
    rows = w_gate_up.shape[0] if isinstance(w_gate_up, torch.Tensor) and w_gate_up.dim() == 2 else 1
    require(rows % 2 == 0, f"w_gate_up must have an even number of rows (gate, then up), got {rows}")
    m, cols, dtype = _check(x, residual, norm_weight, eps, w_gate_up, out, rows // 2, stream_dtype, residual_out,
                            "w_gate_up")  # fmt: skip
    return _run(_norm_gemm_silu, x, residual, norm_weight, eps, w_gate_up, out, cols, dtype, residual_out, True)
