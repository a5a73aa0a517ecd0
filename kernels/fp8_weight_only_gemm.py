"""FP8 weight-only GEMM (W8A16): bf16/fp16 activations times e4m3 weights with per-channel scales.

    fp8_weight_only_gemm(x [M, K], w_fp8 [N, K], w_scale [N] or [N, 1]) -> out [M, N] in x's dtype
    out = x @ (w_fp8 * w_scale)^T, accumulated in float32

The path for GPUs without fp8 tensor cores (before SM 8.9: A100) and the one `--fp8-mode
weight-only` forces anywhere. Each weight tile crosses memory as one byte per element and is
converted to x's dtype in registers right after the load (e4m3 -> bf16 / fp16 is exact: every
e4m3 value is representable), then multiplied on the bf16 / fp16 tensor cores; activations are
never quantized. Two decodings (`decode`):
  * "native": Triton's e4m3 conversion (the cvt instruction of SM 8.9 and later).
  * "bits": the weight read as uint8 and its bits placed in a float16's fields, sign to sign,
    exponent and mantissa shifted by 7, which is the e4m3 value / 256 exactly (normal and subnormal
    alike; the epilogue multiplies the 256 back). Triton has no e4m3 type before SM 8.9, so this is
    the A100's path; a few integer operations per weight. The per-output-channel scale is constant along K, so it is applied once to the
float32 sums in the epilogue rather than to every tile. Decode-sized batches (M <= SMALL_M) split K
across programs, adding float32 partial sums atomically, so enough programs stream the weight; their
tiles may swap operands so the weight rows fill the tensor cores' M side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels import gemm_common as common
from sits.kernels.gemm_common import split_k_tile, store_tile
from sits.kernels.launch_utils import (
    HALF_DTYPES,
    autotune,
    check_inner_contiguous,
    check_tensor,
    is_interpreter,
    require,
)
from sits.kernels.launch_utils import length_bucket as bucket_of
from sits.kernels.reference import fp8_weight_only_gemm_reference

__all__ = ["DECODES", "fp8_weight_only_gemm", "fp8_weight_only_gemm_reference", "native_decode_supported"]

SMALL_M = 64

# Decode sizes: split-K tiles of 16 or 64 rows, the weight either as the dot's N side or (swapped)
# as its M side, where 64 or 128 weight rows fill the tensor cores' natural height.
_SPLITS = ((1, 4), (2, 4), (4, 4), (8, 3))
_SMALL_M_CONFIGS = [c for swap in (False, True) for c in common.split_k_configs((64, 128), _SPLITS, SWAP_AB=swap)]
# Prefill sizes: the bf16 tensor cores' usual tiles (the weight arrives as 1 byte, dequantized in registers).
_LARGE_M_CONFIGS = common.gemm_configs(
    {(8, 3): ((128, 256, 64),), (8, 4): ((128, 128, 64), (128, 128, 128)), (4, 4): ((128, 64, 64), (64, 128, 128))},
    SWAP_AB=False,
)
_INTERPRETER_LARGE_M = common.gemm_config(16, 32, 32, 4, 1, SWAP_AB=False)
_INTERPRETER_SMALL_M = common.gemm_config(16, 32, 32, 4, 1, split_k=2, atomic=True, SWAP_AB=True)


def _prune_small_m(configs, named_args, **kwargs):
    """Row tiles of 16 for batches of up to 16 rows, of 64 above; a split needs two K tiles per program."""
    m_bucket = kwargs.get("M_BUCKET", named_args.get("M_BUCKET"))
    k = named_args["K"]
    kept = [
        c for c in configs
        if (c.kwargs["BLOCK_M"] == 16) == (m_bucket <= 16) and k >= c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"] * 2
    ]
    return kept or configs[:1]  # any config computes the product; an empty K share adds zeros


@triton.jit
def _load_k_tile(ptrs, k, K, EVEN_K: tl.constexpr, K_AXIS: tl.constexpr):
    """One tile of x or w along K (masked past K unless every tile is whole).

    One return at the end: Triton's compiler does not stop at a `return` inside a constexpr `if` of a called
    function (the interpreter does), so an early return would fall through to the code after it.
    """
    if EVEN_K:
        tile = tl.load(ptrs)
    elif K_AXIS == 0:
        tile = tl.load(ptrs, mask=k[:, None] < K, other=0.0)
    else:
        tile = tl.load(ptrs, mask=k[None, :] < K, other=0.0)
    return tile


@triton.jit
def _weight_in(w, dtype: tl.constexpr, E4M3_BITS: tl.constexpr):
    """A weight tile in x's dtype: e4m3 converted, or (E4M3_BITS) uint8 e4m3 bits decoded as value / 256."""
    if E4M3_BITS:  # one return at the end, as in _load_k_tile
        u = w.to(tl.uint16)
        bits = (((u & 0x7F) << 7) | ((u & 0x80) << 8)).to(tl.uint16)
        tile = bits.to(tl.float16, bitcast=True).to(dtype)
    else:
        tile = w.to(dtype)
    return tile


@triton.jit
def _fp8_weight_only_kernel(
    x_ptr, w_ptr, w_scale_ptr, c_ptr,
    M, N, K, stride_xm, stride_wn, stride_cm, M_BUCKET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, ATOMIC: tl.constexpr,
    SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, E4M3_BITS: tl.constexpr,
):  # fmt: skip
    dtype = x_ptr.dtype.element_ty  # the weight is converted to it after each load (exact from e4m3)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_m, offs_n, rows_x, rows_w, first, last = split_k_tile(M, N, k_tiles, BLOCK_M, BLOCK_N, SPLIT_K, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:  # [BLOCK_N, BLOCK_K] weight rows times [BLOCK_K, BLOCK_M] activations
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for tile in range(first, last):
            k = tile * BLOCK_K + offs_k
            x_t = _load_k_tile(x_ptr + rows_x[None, :] * stride_xm + k[:, None], k, K, EVEN_K, 0)
            w = _load_k_tile(w_ptr + rows_w[:, None] * stride_wn + k[None, :], k, K, EVEN_K, 1)
            acc_t = tl.dot(_weight_in(w, dtype, E4M3_BITS), x_t, acc_t)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for tile in range(first, last):
            k = tile * BLOCK_K + offs_k
            x = _load_k_tile(x_ptr + rows_x[:, None] * stride_xm + k[None, :], k, K, EVEN_K, 1)
            w_t = _load_k_tile(w_ptr + rows_w[None, :] * stride_wn + k[:, None], k, K, EVEN_K, 0)
            acc = tl.dot(x, _weight_in(w_t, dtype, E4M3_BITS), acc)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    if E4M3_BITS:
        w_scale = w_scale * 256.0  # the decoded weights were value / 256
    store_tile(acc * w_scale[None, :], c_ptr, offs_m, offs_n, M, N, stride_cm, ATOMIC)


_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_fp8_weight_only_kernel)
_KEY = ("M_BUCKET", "N", "K", "E4M3_BITS")
DECODES = ("native", "bits")
_small_m_kernel = autotune(_SMALL_M_CONFIGS, _INTERPRETER_SMALL_M, _KEY, _prune_small_m)(_even_k)
_large_m_kernel = autotune(_LARGE_M_CONFIGS, _INTERPRETER_LARGE_M, _KEY)(_even_k)


def _check_inputs(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> tuple[int, int, int]:
    check_tensor(x, "x", ndim=2, dtypes=HALF_DTYPES)
    check_tensor(w_fp8, "w_fp8", ndim=2, dtypes=(torch.float8_e4m3fn,), device=x.device)
    m, k = x.shape
    n = w_fp8.shape[0]
    require(w_fp8.shape[1] == k, f"x is [M, {k}] but w_fp8 is {tuple(w_fp8.shape)}; expected [N, {k}]")
    require(k > 0, "K must be positive")
    check_inner_contiguous(x, "x")
    check_inner_contiguous(w_fp8, "w_fp8")
    check_tensor(w_scale, "w_scale", dtypes=(torch.float32,), device=x.device)
    require(w_scale.numel() == n and w_scale.is_contiguous(), f"w_scale must be a contiguous [{n}] or [{n}, 1]")
    return m, n, k


def native_decode_supported(device: torch.device) -> bool:
    """Whether Triton converts e4m3 on `device` (SM 8.9 and later; the interpreter too)."""
    return is_interpreter() or device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_weight_only_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                         decode: str | None = None) -> torch.Tensor:
    """x @ (w_fp8 * w_scale)^T with the weight dequantized inside the GEMM's load.

    Args:
        x: [M, K] bfloat16 / float16 activations, last dimension contiguous.
        w_fp8: [N, K] float8_e4m3fn weights (nn.Linear layout), from quantize_weight_fp8_per_channel.
        w_scale: [N] or [N, 1] float32 per-output-channel scales.
        decode: "native" or "bits" (module docstring); None: native where Triton supports it.
    Returns:
        [M, N] in x's dtype.
    Raises:
        ValueError: wrong dtypes, shapes or layouts, an unknown decode, or native where unsupported.
    """
    m, n, k = _check_inputs(x, w_fp8, w_scale)
    if decode is None:
        decode = "native" if native_decode_supported(x.device) else "bits"
    require(decode in DECODES, f"decode must be one of {DECODES}, got {decode!r}")
    require(decode == "bits" or native_decode_supported(x.device),
            "decode 'native' needs SM 8.9 or later (Triton has no e4m3 type before); use 'bits'")
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    small = m <= SMALL_M
    kernel = _small_m_kernel if small else _large_m_kernel
    out = torch.empty(m, n, dtype=torch.float32 if small else x.dtype, device=x.device)  # split-K: zeroed by hook
    weight = w_fp8.view(torch.uint8) if decode == "bits" else w_fp8
    kernel[common.split_k_grid(m, n)](
        x, weight, w_scale, out, m, n, k, x.stride(0), w_fp8.stride(0), out.stride(0), bucket_of(m, cap=1 << 16),
        ATOMIC=small, E4M3_BITS=decode == "bits",
    )  # fmt: skip
    return out.to(x.dtype) if small else out
