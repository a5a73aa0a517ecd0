"""Decode attention (paged, split-KV) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.attention_decode import paged_decode_attention, paged_decode_attention_reference
from tests.kernels.helpers import DEVICE, HALF_DTYPES, assert_close, poisoned, randn
from tests.kernels.paged import random_paged_cache

HEAD_LAYOUTS = [pytest.param(2, 2, id="gqa1"), pytest.param(8, 2, id="gqa4"), pytest.param(8, 1, id="gqa8")]


def _check(cache, q, scale, dtype, **kwargs):
    out = poisoned(*q.shape, dtype=dtype)
    paged_decode_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, scale, out=out, **kwargs)
    scales = {k: v for k, v in kwargs.items() if k in ("k_scale", "v_scale")}
    expected = paged_decode_attention_reference(
        q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, scale, **scales
    )
    assert not out.isnan().any(), "output has unwritten (NaN) elements"
    assert_close(out, expected, dtype, scale=2.0)
    return out


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(dtype, num_q_heads, num_kv_heads, block_size, num_splits):
    torch.manual_seed(block_size + num_q_heads + num_splits)
    seq_lens = [1, 37, 300, 129]  # single token, ragged, not multiples of the block size
    cache = random_paged_cache(seq_lens, num_kv_heads, 64, block_size, dtype)
    q = randn(len(seq_lens), num_q_heads, 64, dtype=dtype)
    _check(cache, q, 0.125, dtype, num_splits=num_splits)


def test_padding_rows_with_zero_length_return_zeros():
    torch.manual_seed(2)
    cache = random_paged_cache([40, 0, 17, 0], 2, 64, 16, torch.float16)
    cache.block_tables[1] = 10_000_000  # a padding row's table must never be read
    cache.block_tables[3] = -5
    q = randn(4, 4, 64, dtype=torch.float16)
    for splits in (1, 2):
        out = _check(cache, q, 0.125, torch.float16, num_splits=splits)
        assert out[1].abs().max() == 0 and out[3].abs().max() == 0


def test_automatic_splits_and_head_dim_128():
    torch.manual_seed(3)
    cache = random_paged_cache([700, 5], 1, 128, 16, torch.float16)
    q = randn(2, 4, 128, dtype=torch.float16)
    _check(cache, q, 128**-0.5, torch.float16)


def _fp8_cache(seq_lens, block_size=16):
    """A 2-KV-head fp8 cache quantized on the host with torch's cast (the interpreter's is inexact)."""
    cache = random_paged_cache(seq_lens, 2, 64, block_size, torch.float16)
    cache.k_cache = (cache.k_cache.float() / 0.04).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache.v_cache = (cache.v_cache.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = {"k_scale": torch.tensor([0.02, 0.05], device=DEVICE), "v_scale": torch.tensor([0.03, 0.01], device=DEVICE)}
    return cache, scales


# The float16-dot path does no bf16 arithmetic, so its bf16-query case runs in the interpreter too.
FP8_CONVERSIONS = [
    pytest.param(torch.float16, True, id="fp16-f16dots"),
    pytest.param(torch.float16, False, id="fp16-upcast"),
    pytest.param(torch.bfloat16, True, id="bf16-f16dots"),
    pytest.param(torch.bfloat16, False, id="bf16-upcast", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("dtype,via_float16", FP8_CONVERSIONS)
def test_fp8_cache_with_per_head_scales(dtype, via_float16):
    """Both fp8 conversions (float16 dots, tiles upcast to q's dtype) for fp16 and bf16 queries."""
    torch.manual_seed(4)
    cache, scales = _fp8_cache([50, 200, 1])
    q = randn(3, 8, 64, dtype=dtype)
    for splits in (1, 2):
        _check(cache, q, 0.125, dtype, num_splits=splits, fp8_via_float16=via_float16, **scales)


def test_fp8_float16_dots_clamp_queries_beyond_float16_range():
    """A bf16 query past float16's range is clamped to +-65504, not turned into inf / NaN."""
    torch.manual_seed(5)
    cache, scales = _fp8_cache([70, 9])
    q = randn(2, 4, 64, dtype=torch.bfloat16, scale=1e-3)
    q[0, 1, 3], q[1, 2, 0] = 1e6, -3e5
    out = _check_clamped(cache, q, scales)
    assert out.isfinite().all()


def _check_clamped(cache, q, scales):
    out = poisoned(*q.shape, dtype=q.dtype)
    args = (cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 1e-5)
    paged_decode_attention(q, *args, out=out, num_splits=1, **scales)
    expected = paged_decode_attention_reference(q.clamp(-65504, 65504), *args, **scales)
    assert_close(out, expected, q.dtype, scale=2.0)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_dtype,via_float16", [(torch.bfloat16, True), (torch.float8_e4m3fn, True),
                                                   (torch.float8_e4m3fn, False)], ids=["bf16", "fp8", "fp8-upcast"])
def test_long_contexts_gpu(head_dim, block_size, kv_dtype, via_float16):
    torch.manual_seed(head_dim + block_size)
    seq_lens = [8191, 1, 2048, 0, 5000, 33]
    cache = random_paged_cache(seq_lens, 8, head_dim, block_size, torch.bfloat16)
    scales = {}
    if kv_dtype == torch.float8_e4m3fn:
        scales = {"fp8_via_float16": via_float16, "k_scale": torch.full((8,), 0.01, device=DEVICE), "v_scale": torch.full((8,), 0.02, device=DEVICE)}
        cache.k_cache = (cache.k_cache.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
        cache.v_cache = (cache.v_cache.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = randn(len(seq_lens), 32, head_dim, dtype=torch.bfloat16)
    _check(cache, q, head_dim**-0.5, torch.bfloat16, **scales)
    _check(cache, q, head_dim**-0.5, torch.bfloat16, num_splits=1, **scales)


def test_bad_input_raises_value_error():
    cache = random_paged_cache([4], 2, 64, 16, torch.float16)
    q = randn(1, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="seq_lens must have dtype"):
        paged_decode_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens.long(), 0.1)
    with pytest.raises(ValueError, match="needs k_scale"):
        fp8 = cache.k_cache.to(torch.float8_e4m3fn)
        paged_decode_attention(q, fp8, fp8, cache.block_tables, cache.seq_lens, 0.1)
    with pytest.raises(ValueError, match="num_splits must be"):
        paged_decode_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.1, num_splits=0)
