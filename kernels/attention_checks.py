"""Input checks shared by the attention launchers; each raises ValueError naming the argument."""

from __future__ import annotations

import torch

from sits.kernels.launch_utils import HALF_DTYPES, check_inner_contiguous, check_shape, check_tensor, require

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
FP8_CACHE_DTYPE = torch.float8_e4m3fn


def check_query(q: torch.Tensor, dtypes: tuple[torch.dtype, ...] = HALF_DTYPES) -> tuple[int, int, int]:
    """q [tokens or sequences, Hq, D] in one of `dtypes` (fp16/bf16 by default) with a supported head_dim;
    returns its shape."""
    check_tensor(q, "q", ndim=3, dtypes=dtypes)
    check_inner_contiguous(q, "q")
    head_dim = q.shape[2]
    require(head_dim in SUPPORTED_HEAD_DIMS, f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    return q.shape


def check_kv_heads(num_q_heads: int, num_kv_heads: int) -> None:
    require(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})",
    )


def check_paged_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """k_cache/v_cache [num_blocks, block_size, Hkv, D] in one of `dtypes` (None: q's dtype or fp8), matching
    q's D and heads."""
    allowed = (q.dtype, FP8_CACHE_DTYPE) if dtypes is None else dtypes
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        check_tensor(cache, name, ndim=4, dtypes=allowed, device=q.device)
        check_inner_contiguous(cache, name)
    require(k_cache.shape == v_cache.shape, "k_cache and v_cache must have the same shape")
    require(k_cache.dtype == v_cache.dtype, "k_cache and v_cache must have the same dtype")
    require(k_cache.shape[3] == q.shape[2], f"the caches' head_dim {k_cache.shape[3]} differs from q's {q.shape[2]}")
    check_kv_heads(q.shape[1], k_cache.shape[2])


def check_index(tensor: torch.Tensor, name: str, length: int | None, device: torch.device) -> None:
    """A contiguous 1-D int32 tensor, of `length` entries when given."""
    check_tensor(tensor, name, ndim=1, dtypes=(torch.int32,), device=device)
    if length is not None:
        check_shape(tensor, name, (length,))
    require(tensor.is_contiguous(), f"{name} must be contiguous")


def check_block_tables(block_tables: torch.Tensor, num_seqs: int, device: torch.device) -> None:
    check_tensor(block_tables, "block_tables", ndim=2, dtypes=(torch.int32,), device=device)
    require(block_tables.shape[0] >= num_seqs, f"block_tables needs a row for each of the {num_seqs} sequences")
    check_inner_contiguous(block_tables, "block_tables")


def check_fp8_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Scales [Hkv] float32 are required with an fp8 cache and refused without one; returns is-fp8."""
    fp8 = cache.dtype == FP8_CACHE_DTYPE
    for scale, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        if not fp8:
            require(scale is None, f"{name} is only used with an fp8 cache")
            continue
        require(scale is not None, f"an fp8 cache needs {name} [num_kv_heads] float32")
        check_tensor(scale, name, ndim=1, dtypes=(torch.float32,), device=cache.device)
        check_shape(scale, name, (cache.shape[2],))
        require(scale.is_contiguous(), f"{name} must be contiguous")
    return fp8


def prepare_out(out: torch.Tensor | None, q: torch.Tensor,
                dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
    """The caller's output buffer after checks (in one of `dtypes`; None: q's dtype), or a new one like q."""
    if out is None:
        return torch.empty_like(q)
    check_tensor(out, "out", dtypes=(q.dtype,) if dtypes is None else dtypes, device=q.device)
    check_shape(out, "out", q.shape)
    check_inner_contiguous(out, "out")
    return out
