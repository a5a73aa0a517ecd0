"""FP8 (e4m3) GEMM with per-token activation scales and per-channel weight scales, on tensor cores.

    fp8_gemm(a_fp8 [M, K], a_scale [M, 1], w_fp8 [N, K], w_scale [N] or [N, 1]) -> out [M, N] bf16
    out = (a_fp8 @ w_fp8^T) * a_scale * w_scale^T, accumulated in float32

Weights keep nn.Linear's [N, K] layout, which is what Hopper's fp8 wgmma wants (both operands
K-major). Four paths, picked by shape:
  * M > SMALL_M on a GPU: tensor-memory-accelerator (TMA) loads through host tensor descriptors,
    grouped tile order for L2 reuse, autotuned tile shapes.
  * M <= 64 and K <= 2 N (`small_m_direct`; decode batches, where the weight read dominates): the
    "direct" kernel. No split along K: narrow column tiles (BLOCK_N 16-128) give enough programs,
    each streams its [BLOCK_N, K] slice of the weight through a deep load pipeline and writes the
    output dtype itself. One launch per call (no float32 buffer to zero, no cast kernel).
  * M <= SMALL_M otherwise (the "atomic" kernel): pointer loads split along K so that enough
    programs stream the weight; partial sums land in a float32 buffer with atomic adds (a memset,
    the GEMM and a cast: three launches).
  * Otherwise (and under the interpreter): the same pointer kernel without the split.
The activation quantizer lives in fp8_quantize.py; weight helpers in quantization.py.

`fp8_gemm_on(backend, ...)` runs the same product on the backend a measured table chose
(sits.kernels.fp8_accum): this Triton kernel (precise or fast sums) or torch._scaled_mm with rowwise
scales; operands torch._scaled_mm cannot take as they are fall back to the precise Triton kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.fp8_accum import BACKENDS, SCALED_MM_BACKENDS
from sits.kernels.fp8_quantize import quantize_fp8_per_token
from sits.kernels.gemm_common import (
    gemm_config,
    gemm_configs,
    grouped_tile_coordinates,
    split_k_configs,
    split_k_grid,
    split_k_tile,
    store_tile,
)
from sits.kernels.launch_utils import (
    autotune,
    check_inner_contiguous,
    check_tensor,
    is_interpreter,
    length_bucket,
    require,
)
from sits.kernels.pdl import pdl_launch_options, pdl_wait
from sits.kernels.quantization import quantize_weight_fp8_per_channel
from sits.kernels.reference import fp8_gemm_reference

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer kernels only
    TensorDescriptor = None

__all__ = [
    "fp8_gemm",
    "fp8_gemm_on",
    "fp8_gemm_scaled_mm",
    "scaled_mm_runs",
    "scaled_mm_usable",
    "fp8_gemm_reference",
    "quantize_fp8_per_token",
    "quantize_weight_fp8_per_channel",
]

SMALL_M = 128
DIRECT_MAX_M = 64  # the direct kernel's row tile is at most 64 rows: above, the atomic kernel serves
DIRECT_MAX_K_PER_N = 2  # longer K per output column: split-K wins (see small_m_direct)
SMALL_M_KERNELS = ("direct", "atomic")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PRECISE_K = 128  # precise sums are promoted to float32 every PRECISE_K elements of K (torch._scaled_mm's cadence)


_LARGE_M_POINTER_CONFIGS = gemm_configs(
    {(8, 4): ((128, 128, 128),), (4, 4): ((128, 128, 128), (128, 64, 128), (64, 128, 128))}
)
_SMALL_M_CONFIGS = split_k_configs((32, 64, 128), ((1, 5), (2, 5), (4, 4), (8, 4)))
_INTERPRETER_CONFIG = gemm_config(16, 32, 32, 4, 1)
_INTERPRETER_SPLIT_CONFIG = gemm_config(16, 32, 32, 4, 1, split_k=2, atomic=True)


def _prune_small_m(configs, named_args, **kwargs):
    m_bucket = kwargs.get("M_BUCKET", named_args.get("M_BUCKET"))
    k = named_args["K"]
    kept = [
        c
        for c in configs
        if (c.kwargs["BLOCK_M"] == 16) == (m_bucket <= 16) and k >= c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"] * 2
    ]
    return kept or configs[:1]


@triton.jit
def _scale_and_store(acc, c_ptr, a_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_cm, ATOMIC: tl.constexpr):
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    store_tile(acc * a_scale[:, None] * w_scale[None, :], c_ptr, offs_m, offs_n, M, N, stride_cm, ATOMIC)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr,
    M, N, K, stride_am, stride_wn, stride_cm, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr, ATOMIC: tl.constexpr, FAST_ACCUM: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_wait(USE_PDL)
    offs_m, offs_n, rows_a, rows_w, first, last = split_k_tile(M, N, tl.cdiv(K, BLOCK_K), BLOCK_M, BLOCK_N, SPLIT_K,
                                                               GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(first, last):
        k = tile * BLOCK_K + offs_k
        if EVEN_K:
            a = tl.load(a_ptr + rows_a[:, None] * stride_am + k[None, :])
            w = tl.load(w_ptr + rows_w[None, :] * stride_wn + k[:, None])
        else:
            a = tl.load(a_ptr + rows_a[:, None] * stride_am + k[None, :], mask=k[None, :] < K, other=0.0)
            w = tl.load(w_ptr + rows_w[None, :] * stride_wn + k[:, None], mask=k[:, None] < K, other=0.0)
        if FAST_ACCUM:
            acc = tl.dot(a, w, acc)
        else:
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
    _scale_and_store(acc, c_ptr, a_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_cm, ATOMIC)


# Whole K tiles need no load masks, which keeps the fp8 loads 16 bytes wide and asynchronous.
_fp8_gemm_kernel_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(
    _fp8_gemm_kernel
)
_KEY = ("M_BUCKET", "N", "K", "FAST_ACCUM")
_fp8_gemm_small_m = autotune(_SMALL_M_CONFIGS, _INTERPRETER_SPLIT_CONFIG, _KEY, _prune_small_m)(_fp8_gemm_kernel_even_k)
_fp8_gemm_large_m = autotune(_LARGE_M_POINTER_CONFIGS, _INTERPRETER_CONFIG, _KEY)(_fp8_gemm_kernel_even_k)


def _direct_config(block_n, block_k, swap_ab, warps, stages) -> triton.Config:
    """One config of the direct kernel (BLOCK_M is not tuned: it follows M, see `_direct_block_m`)."""
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, "SWAP_AB": swap_ab, "PROMOTE_K": min(block_k, PRECISE_K)},
        num_warps=warps, num_stages=stages,
    )


# (BLOCK_N, BLOCK_K, SWAP_AB, warps, stages). Narrow column tiles put >= ~128 programs on the weight
# of an N = 4096 projection; wide K tiles and deep pipelines keep enough weight bytes in flight per
# program. SWAP_AB computes out^T = W A^T so the weight tile is the MMA's M side (64 rows: Hopper's
# wgmma) and the few activation rows its N side, instead of padding the activations to 16+ rows.
# These are the configs the autotuner picked on an H200 for Llama-3-8B's projections at M = 1 to 64,
# out of 14 tried (bench_fp8_small_m.py); the other seven never won a shape.
_DIRECT_CONFIGS = [
    _direct_config(*c)
    for c in (
        (16, 512, False, 4, 4), (32, 128, False, 4, 6), (32, 512, False, 4, 3), (32, 256, True, 4, 4),
        (64, 128, True, 4, 6), (64, 256, True, 4, 4), (128, 256, True, 8, 3),
    )
]
_INTERPRETER_DIRECT_CONFIG = _direct_config(32, 32, False, 4, 1)


def _prune_direct(configs, named_args, **kwargs):
    """Drop K tiles wider than K itself (they would load mostly masked zeros)."""
    kept = [c for c in configs if c.kwargs["BLOCK_K"] <= max(named_args["K"], 128)]
    return kept or configs[:1]


def _direct_block_m(m: int) -> int:
    """The direct kernel's row tile for M rows: a power of two from 16 (tl.dot's minimum) to 64."""
    return min(max(length_bucket(m), 16), DIRECT_MAX_M)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one binary per row tile, not per batch size
def _fp8_gemm_direct_kernel(
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr,
    M, N, K, stride_am, stride_wn, stride_cm, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    PROMOTE_K: tl.constexpr, FAST_ACCUM: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """c [M, N] = (a @ w^T) * a_scale * w_scale^T in c's dtype; grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).

    Each program sums the whole K for one [BLOCK_M, BLOCK_N] tile (row tiles of one column tile are
    neighbours in launch order, so a weight slice read by several row tiles is still in L2). Columns
    past N are wrapped for the loads and masked at the store. Activation rows past M are masked at
    the load as well (not wrapped): a batch of 1 to 15 rows in a 16-row tile reads only its rows
    from L2, once per program. Precise sums (FAST_ACCUM false) are promoted to float32 every
    PROMOTE_K elements of K. USE_PDL: launched with programmatic dependent launch (sits.kernels.pdl).
    """
    pdl_wait(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = offs_m.to(tl.int64)
    in_m = offs_m < M
    rows_w = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if SWAP_AB:  # w [BLOCK_N, BLOCK_K] and a^T [BLOCK_K, BLOCK_M], both K-major
            if EVEN_K:
                w = tl.load(w_ptr + rows_w[:, None] * stride_wn + k[None, :])
                a = tl.load(a_ptr + rows_a[None, :] * stride_am + k[:, None], mask=in_m[None, :], other=0.0)
            else:
                w = tl.load(w_ptr + rows_w[:, None] * stride_wn + k[None, :], mask=k[None, :] < K, other=0.0)
                a = tl.load(a_ptr + rows_a[None, :] * stride_am + k[:, None], mask=in_m[None, :] & (k[:, None] < K),
                            other=0.0)
            if FAST_ACCUM:
                acc = tl.dot(w, a, acc)
            else:
                acc = tl.dot(w, a, acc, max_num_imprecise_acc=PROMOTE_K)
        else:  # a [BLOCK_M, BLOCK_K] and w^T [BLOCK_K, BLOCK_N]
            if EVEN_K:
                a = tl.load(a_ptr + rows_a[:, None] * stride_am + k[None, :], mask=in_m[:, None], other=0.0)
                w = tl.load(w_ptr + rows_w[None, :] * stride_wn + k[:, None])
            else:
                a = tl.load(a_ptr + rows_a[:, None] * stride_am + k[None, :], mask=in_m[:, None] & (k[None, :] < K),
                            other=0.0)
                w = tl.load(w_ptr + rows_w[None, :] * stride_wn + k[:, None], mask=k[:, None] < K, other=0.0)
            if FAST_ACCUM:
                acc = tl.dot(a, w, acc)
            else:
                acc = tl.dot(a, w, acc, max_num_imprecise_acc=PROMOTE_K)
    if SWAP_AB:
        acc = tl.trans(acc)
    _scale_and_store(acc, c_ptr, a_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_cm, False)


_fp8_gemm_direct_kernel_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(
    _fp8_gemm_direct_kernel
)
_fp8_gemm_direct = autotune(_DIRECT_CONFIGS, _INTERPRETER_DIRECT_CONFIG, _KEY, _prune_direct)(
    _fp8_gemm_direct_kernel_even_k
)


def small_m_direct(m: int, n: int, k: int) -> bool:
    """Whether fp8_gemm runs an [m, k] x [n, k] product (m <= SMALL_M) on the direct kernel (else atomic).

    The rule: m <= DIRECT_MAX_M (the direct kernel's largest row tile) and K <= DIRECT_MAX_K_PER_N * N.
    Measured on an H200 (benchmarks/bench_fp8_small_m.py, CUDA graphs, Llama-3-8B at M = 1, 8, 16, 32,
    64): where K <= N (qkv, o, gate_up) the direct kernel takes 0.57 to 1.00x the time of the atomic
    path; where K = 3.5 N (down: N 4,096, K 14,336) it takes 1.15 to 1.28x, because each of its
    programs walks the whole long K while split-K spreads it over more programs. Ratios between 1
    and 3.5 were not measured; the bound sits between.
    """
    return 0 < m <= DIRECT_MAX_M and k <= DIRECT_MAX_K_PER_N * n


def _launch_direct(kernel, a_fp8, a_scale, w_fp8, w_scale, out, fast_accum: bool, **meta) -> None:
    """Launch the direct kernel (`kernel`: the autotuned one, or the raw jit kernel with every
    constexpr in `meta`) writing out [M, N] in its own dtype."""
    m, k = a_fp8.shape
    n = w_fp8.shape[0]
    block_m = _direct_block_m(m)
    grid = lambda meta_: (triton.cdiv(m, block_m), triton.cdiv(n, meta_["BLOCK_N"]))  # noqa: E731
    kernel[grid](
        a_fp8, w_fp8, out, a_scale, w_scale, m, n, k, a_fp8.stride(0), w_fp8.stride(0), out.stride(0),
        length_bucket(m, cap=1 << 16), BLOCK_M=block_m, FAST_ACCUM=bool(fast_accum),
        **{**pdl_launch_options(a_fp8.device), **meta},
    )  # fmt: skip


def _set_tma_blocks(nargs):
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


_TMA_CONFIGS = gemm_configs(
    {(8, 3): ((128, 256, 128), (256, 128, 128)), (8, 4): ((128, 256, 128), (128, 128, 128)),
     (4, 4): ((128, 128, 128),), (4, 5): ((64, 128, 128),)},
    split_k=None, pre_hook=_set_tma_blocks,
)


@triton.autotune(configs=_TMA_CONFIGS, key=list(_KEY))
@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, w_desc, c_ptr, a_scale_ptr, w_scale_ptr,
    M, N, K, stride_cm, M_BUCKET,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile_coordinates(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k * BLOCK_K])
        w = w_desc.load([off_n, k * BLOCK_K])
        if FAST_ACCUM:
            acc = tl.dot(a, w.T, acc)
        else:
            acc = tl.dot(a, w.T, acc, max_num_imprecise_acc=BLOCK_K)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _scale_and_store(acc, c_ptr, a_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_cm, False)


def _check_inputs(a_fp8, a_scale, w_fp8, w_scale, out_dtype):
    check_tensor(a_fp8, "a_fp8", ndim=2, dtypes=(torch.float8_e4m3fn,))
    check_tensor(w_fp8, "w_fp8", ndim=2, dtypes=(torch.float8_e4m3fn,), device=a_fp8.device)
    m, k = a_fp8.shape
    n = w_fp8.shape[0]
    require(w_fp8.shape[1] == k, f"a_fp8 is [M, {k}] but w_fp8 is {tuple(w_fp8.shape)}; expected [N, {k}]")
    require(k % 16 == 0 and k > 0, f"K must be a positive multiple of 16 (fp8 tensor cores), got {k}")
    check_inner_contiguous(a_fp8, "a_fp8")
    check_inner_contiguous(w_fp8, "w_fp8")
    check_tensor(a_scale, "a_scale", dtypes=(torch.float32,), device=a_fp8.device)
    require(a_scale.numel() == m and a_scale.is_contiguous(), f"a_scale must be a contiguous [{m}, 1] float32")
    check_tensor(w_scale, "w_scale", dtypes=(torch.float32,), device=a_fp8.device)
    require(w_scale.numel() == n and w_scale.is_contiguous(), f"w_scale must be a contiguous [{n}] or [{n}, 1]")
    require(out_dtype in OUT_DTYPES, f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    return m, n, k


def _tma_usable(a_fp8: torch.Tensor, w_fp8: torch.Tensor) -> bool:
    return (
        TensorDescriptor is not None
        and not is_interpreter()
        and a_fp8.is_cuda
        and torch.cuda.get_device_capability(a_fp8.device)[0] >= 9
        and a_fp8.stride(0) % 16 == 0
        and w_fp8.stride(0) % 16 == 0
        and a_fp8.data_ptr() % 16 == 0
        and w_fp8.data_ptr() % 16 == 0
    )


def fp8_gemm(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    use_tma: bool | None = None,
    fast_accum: bool = False,
    small_m_kernel: str | None = None,
) -> torch.Tensor:
    """Scaled e4m3 GEMM: out [M, N] = (a_fp8 * a_scale) @ (w_fp8 * w_scale)^T in out_dtype.

    Args:
        a_fp8: [M, K] float8_e4m3fn activations (from quantize_fp8_per_token), K % 16 == 0.
        a_scale: [M, 1] float32 per-token scales.
        w_fp8: [N, K] float8_e4m3fn weights (nn.Linear layout).
        w_scale: [N] or [N, 1] float32 per-output-channel scales.
        out_dtype: bfloat16 (default), float16 or float32.
        use_tma: force the TMA kernel on (True) or off (False) for M > SMALL_M; automatic when None.
        fast_accum: keep Hopper's reduced-precision fp8 tensor-core accumulation over the whole K
            (faster, less exact). By default the sums are promoted to float32 every K tile of 128,
            as torch._scaled_mm does by default.
        small_m_kernel: for M <= SMALL_M, force the "direct" (M <= DIRECT_MAX_M only) or the
            "atomic" kernel; None picks by `small_m_direct`.
    Returns:
        [M, N] in out_dtype.
    Raises:
        ValueError: bad operands, or a small_m_kernel that is unknown or cannot take M.
    """
    m, n, k = _check_inputs(a_fp8, a_scale, w_fp8, w_scale, out_dtype)
    require(small_m_kernel in (None, *SMALL_M_KERNELS),
            f"small_m_kernel must be None or one of {SMALL_M_KERNELS}, got {small_m_kernel!r}")
    require(small_m_kernel != "direct" or m <= DIRECT_MAX_M,
            f"the direct kernel takes M <= {DIRECT_MAX_M}, got M = {m}")
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=out_dtype, device=a_fp8.device)
    bucket = length_bucket(m, cap=1 << 16)
    direct = small_m_direct(m, n, k) if small_m_kernel is None else small_m_kernel == "direct"
    if m <= SMALL_M and direct:
        out = torch.empty(m, n, dtype=out_dtype, device=a_fp8.device)
        _launch_direct(_fp8_gemm_direct, a_fp8, a_scale, w_fp8, w_scale, out, fast_accum)
        return out
    if m <= SMALL_M:
        acc = torch.empty(m, n, dtype=torch.float32, device=a_fp8.device)  # zeroed by the config pre-hook
        _fp8_gemm_small_m[split_k_grid(m, n)](
            a_fp8, w_fp8, acc, a_scale, w_scale, m, n, k, a_fp8.stride(0), w_fp8.stride(0), acc.stride(0), bucket,
            ATOMIC=True, FAST_ACCUM=bool(fast_accum), **pdl_launch_options(a_fp8.device),
        )  # fmt: skip
        return acc if out_dtype == torch.float32 else acc.to(out_dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=a_fp8.device)
    grid2d = split_k_grid(m, n)  # SPLIT_K is 1 in every large-M config

    tma = _tma_usable(a_fp8, w_fp8) if use_tma is None else bool(use_tma) and _tma_usable(a_fp8, w_fp8)
    if tma:
        placeholder = [16, 16]  # the config pre-hook sets the real block shapes
        a_desc = TensorDescriptor(a_fp8, list(a_fp8.shape), list(a_fp8.stride()), placeholder)
        w_desc = TensorDescriptor(w_fp8, list(w_fp8.shape), list(w_fp8.stride()), placeholder)
        _fp8_gemm_tma_kernel[grid2d](
            a_desc, w_desc, out, a_scale, w_scale, m, n, k, out.stride(0), bucket, FAST_ACCUM=bool(fast_accum)
        )
    else:
        _fp8_gemm_large_m[grid2d](
            a_fp8, w_fp8, out, a_scale, w_scale, m, n, k, a_fp8.stride(0), w_fp8.stride(0), out.stride(0), bucket,
            ATOMIC=False, FAST_ACCUM=bool(fast_accum),
        )  # fmt: skip
    return out


SCALED_MM_MIN_CAPABILITY = (8, 9)  # rowwise-scaled torch._scaled_mm: SM 8.9 (CUTLASS) and SM 9.0+ (CUTLASS / cuBLASLt)
SCALED_MM_OUT_DTYPES = (torch.bfloat16,)  # the rowwise output every torch release since 2.4 accepts


def scaled_mm_usable(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm's rowwise-scaled e4m3 GEMM takes these operands as they are.

    What PyTorch checks (ScaledBlas.cpp, RowwiseScaledMM.cu): a CUDA GPU of SM 8.9 or later; e4m3
    operands, a row-major [M, K] and a column-major [K, N] (w_fp8.t() of a row-major [N, K]); K and
    N multiples of 16; float32 scales of M and N elements (passed as [M, 1] and [1, N], contiguous);
    a bf16 output. The vendor kernels also load rows with 16-byte vectors, so each operand's row
    stride and base address are multiples of 16 bytes. Host-side checks only: no device sync.
    """
    if not (a_fp8.is_cuda and a_fp8.dim() == 2 and w_fp8.dim() == 2 and out_dtype in SCALED_MM_OUT_DTYPES):
        return False
    m, k = a_fp8.shape
    n = w_fp8.shape[0]
    return (
        a_fp8.dtype == w_fp8.dtype == torch.float8_e4m3fn
        and w_fp8.device == a_fp8.device
        and torch.cuda.get_device_capability(a_fp8.device) >= SCALED_MM_MIN_CAPABILITY
        and m > 0 and w_fp8.shape[1] == k and k % 16 == 0 and n % 16 == 0
        and a_fp8.stride(1) == 1 and w_fp8.stride(1) == 1
        and a_fp8.stride(0) % 16 == 0 and w_fp8.stride(0) % 16 == 0
        and a_fp8.data_ptr() % 16 == 0 and w_fp8.data_ptr() % 16 == 0
        and a_scale.dtype == w_scale.dtype == torch.float32
        and a_scale.numel() == m and w_scale.numel() == n
        and a_scale.is_contiguous() and w_scale.is_contiguous()
        and a_scale.device == w_scale.device == a_fp8.device
    )


def fp8_gemm_scaled_mm(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False) -> torch.Tensor:
    """fp8_gemm's product on torch._scaled_mm with rowwise scales (operands as `scaled_mm_usable` needs).

    Args:
        a_fp8: [M, K] float8_e4m3fn, row-major; a_scale: [M, 1] (or [M]) float32.
        w_fp8: [N, K] float8_e4m3fn, row-major (passed as its column-major transpose [K, N]);
            w_scale: [N] or [N, 1] float32 (passed as [1, N]).
        out_dtype: the output dtype.
        fast_accum: torch's use_fast_accum (reduced-precision sums over the whole K).
    Returns:
        [M, N] in out_dtype.
    """
    return torch._scaled_mm(a_fp8, w_fp8.t(), scale_a=a_scale.reshape(-1, 1), scale_b=w_scale.reshape(1, -1),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


def fp8_gemm_on(backend: str, a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor,
                w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8_gemm's product on `backend` (sits.kernels.fp8_accum.BACKENDS).

    "scaled_mm" / "scaled_mm_fast" run torch._scaled_mm where `scaled_mm_usable` holds, else the
    precise Triton kernel (the only figure the table guarantees for every shape); "triton" /
    "triton_fast" run fp8_gemm with precise / fast sums. Shapes and dtypes as fp8_gemm; CUDA-graph
    safe (the choice is made on the host from shapes, strides and addresses).
    Raises:
        ValueError: an unknown backend, or inputs fp8_gemm rejects.
    """
    require(backend in BACKENDS, f"fp8 GEMM backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend in SCALED_MM_BACKENDS:
        if scaled_mm_usable(a_fp8, a_scale, w_fp8, w_scale, out_dtype):
            return fp8_gemm_scaled_mm(a_fp8, a_scale, w_fp8, w_scale, out_dtype, fast_accum=backend == "scaled_mm_fast")
        return fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype=out_dtype)
    return fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype=out_dtype, fast_accum=backend == "triton_fast")


def scaled_mm_runs(device: torch.device) -> bool:
    """Whether this PyTorch build runs rowwise-scaled torch._scaled_mm on `device` (one tiny product,
    checked against the reference; a host sync: call it at start-up, not while capturing a graph)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < SCALED_MM_MIN_CAPABILITY:
        return False
    a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
    w = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
    a_scale = torch.full((16, 1), 0.5, device=device)
    w_scale = torch.full((16,), 2.0, device=device)
    if not scaled_mm_usable(a, a_scale, w, w_scale, torch.bfloat16):
        return False
    try:
        out = fp8_gemm_scaled_mm(a, a_scale, w, w_scale)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return bool(torch.equal(out.float(), torch.full((16, 16), 32.0, device=device)))
