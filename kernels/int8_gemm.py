"""INT8 weight-only GEMM (W8A16): bf16/fp16 activations times int8 weights with per-group scales.

    int8_weight_only_gemm(x [M, K], w_int8 [N, K], scales [N, K // group_size]) -> out [M, N]
    out = x @ (w_int8 * scales expanded along K)^T, accumulated in float32, in x's dtype

Each K tile of the weight is dequantized in registers (int8 -> float32, times its group's scale,
rounded to x's dtype, exactly as the reference dequantizes) right before the tensor-core dot, so
the weight crosses memory as one byte per element. Decode-sized batches (M <= SMALL_M) split K
across programs, adding float32 partial sums atomically, so enough programs stream the weight.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sits.kernels.gemm_common import (
    gemm_config,
    gemm_configs,
    split_k_configs,
    split_k_grid,
    split_k_tile,
    store_tile,
)
from sits.kernels.launch_utils import (
    HALF_DTYPES,
    autotune,
    check_inner_contiguous,
    check_shape,
    check_tensor,
    length_bucket,
    require,
)
from sits.kernels.quantization import quantize_weight_int8
from sits.kernels.reference import int8_weight_only_gemm_reference

__all__ = ["int8_weight_only_gemm", "int8_weight_only_gemm_reference", "quantize_weight_int8"]

SMALL_M = 64
MIN_GROUP = 32


_config = functools.partial(gemm_config, SWAP_AB=False)
_LARGE_M_CONFIGS = gemm_configs(
    {(8, 3): ((128, 256, 64), (128, 128, 128)), (8, 4): ((128, 128, 64),), (4, 4): ((128, 64, 64), (64, 128, 64))},
    SWAP_AB=False,
)
_SMALL_M_CONFIGS = split_k_configs((64, 128), ((1, 4), (2, 4), (4, 4), (8, 3)), SWAP_AB=False) + split_k_configs(
    # Swapped operands: the weight tile is the dot's M side (64 or 128 rows, the tensor cores'
    # natural height) and the few activation rows its N side.
    (64, 128), ((1, 4), (2, 4), (4, 4)), SWAP_AB=True
)
_INTERPRETER_CONFIG = _config(16, 32, 32, 4, 1)
_INTERPRETER_SPLIT_CONFIG = _config(16, 32, 32, 4, 1, split_k=2, atomic=True, SWAP_AB=True)


def _prune(configs, named_args, **kwargs):
    """Tiles must not straddle a scale group; small batches pick row tiles that fit them."""
    group_size = kwargs.get("GROUP_SIZE", named_args.get("GROUP_SIZE"))
    m_bucket = kwargs.get("M_BUCKET", named_args.get("M_BUCKET"))
    k = named_args["K"]
    kept = []
    for c in configs:
        if group_size % c.kwargs["BLOCK_K"]:
            continue
        if c.kwargs["SPLIT_K"] > 1 and k < c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"] * 2:
            continue
        if m_bucket <= SMALL_M and (m_bucket <= 16) != (c.kwargs["BLOCK_M"] == 16):
            continue
        kept.append(c)
    if kept:
        return kept
    # No tile fits the group: the first config with K tiles one group long.
    first = configs[0]
    kwargs = dict(first.kwargs, BLOCK_K=min(first.kwargs["BLOCK_K"], group_size))
    return [triton.Config(kwargs, num_warps=first.num_warps, num_stages=first.num_stages, pre_hook=first.pre_hook)]


@triton.jit
def _int8_gemm_kernel(
    x_ptr, w_ptr, scales_ptr, c_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_cm, M_BUCKET,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, ATOMIC: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    # K is a multiple of GROUP_SIZE, itself a multiple of BLOCK_K
    offs_m, offs_n, rows_x, rows_w, first, last = split_k_tile(M, N, K // BLOCK_K, BLOCK_M, BLOCK_N, SPLIT_K, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for tile in range(first, last):
            k = tile * BLOCK_K + offs_k
            x_t = tl.load(x_ptr + rows_x[None, :] * stride_xm + k[:, None])
            w = tl.load(w_ptr + rows_w[:, None] * stride_wn + k[None, :])
            scale = tl.load(scales_ptr + rows_w * stride_sn + (tile * BLOCK_K) // GROUP_SIZE)
            w = (w.to(tl.float32) * scale[:, None]).to(x_t.dtype)
            acc_t = tl.dot(w, x_t, acc_t)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for tile in range(first, last):
            k = tile * BLOCK_K + offs_k
            x = tl.load(x_ptr + rows_x[:, None] * stride_xm + k[None, :])
            w = tl.load(w_ptr + rows_w[None, :] * stride_wn + k[:, None])
            scale = tl.load(scales_ptr + rows_w * stride_sn + (tile * BLOCK_K) // GROUP_SIZE)
            w = (w.to(tl.float32) * scale[None, :]).to(x.dtype)
            acc = tl.dot(x, w, acc)
    store_tile(acc, c_ptr, offs_m, offs_n, M, N, stride_cm, ATOMIC)


_KEY = ("M_BUCKET", "N", "K", "GROUP_SIZE")
_int8_gemm_small_m = autotune(_SMALL_M_CONFIGS, _INTERPRETER_SPLIT_CONFIG, _KEY, _prune)(_int8_gemm_kernel)
_int8_gemm_large_m = autotune(_LARGE_M_CONFIGS, _INTERPRETER_CONFIG, _KEY, _prune)(_int8_gemm_kernel)


def int8_weight_only_gemm(
    x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """x @ dequantize(w_int8, scales)^T.

    Args:
        x: [M, K] float16 / bfloat16, last dimension contiguous.
        w_int8: [N, K] int8 (nn.Linear layout), from quantize_weight_int8.
        scales: [N, K // group_size] float32 (or x's dtype) per-group scales.
        group_size: input features per scale; a power of two >= 32 dividing K.
    Returns:
        [M, N] in x's dtype.
    """
    check_tensor(x, "x", ndim=2, dtypes=HALF_DTYPES)
    check_tensor(w_int8, "w_int8", ndim=2, dtypes=(torch.int8,), device=x.device)
    m, k = x.shape
    n = w_int8.shape[0]
    require(w_int8.shape[1] == k, f"x is [M, {k}] but w_int8 is {tuple(w_int8.shape)}; expected [N, {k}]")
    require(
        group_size >= MIN_GROUP and group_size & (group_size - 1) == 0,
        f"group_size must be a power of two >= {MIN_GROUP}, got {group_size}",
    )
    require(k % group_size == 0, f"K ({k}) must be a multiple of group_size ({group_size})")
    check_tensor(scales, "scales", ndim=2, dtypes=(torch.float32, x.dtype), device=x.device)
    check_shape(scales, "scales", (n, k // group_size))
    for tensor, name in ((x, "x"), (w_int8, "w_int8"), (scales, "scales")):
        check_inner_contiguous(tensor, name)
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    small = m <= SMALL_M
    kernel = _int8_gemm_small_m if small else _int8_gemm_large_m
    out = torch.empty(m, n, dtype=torch.float32 if small else x.dtype, device=x.device)
    kernel[split_k_grid(m, n)](
        x, w_int8, scales, out, m, n, k, x.stride(0), w_int8.stride(0), scales.stride(0), out.stride(0),
        length_bucket(m, cap=1 << 16), GROUP_SIZE=group_size, ATOMIC=small,
    )  # fmt: skip
    return out.to(x.dtype) if small else out
