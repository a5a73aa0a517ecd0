"""Prefill attention (contiguous varlen and paged) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.attention_prefill import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
    varlen_attention_reference,
    varlen_prefill_attention,
)
from tests.kernels.helpers import DEVICE, HALF_DTYPES, assert_close, poisoned, randn
from tests.kernels.paged import cumulative, random_paged_cache

# (query heads, kv heads): GQA ratios 1, 4 and 8
HEAD_LAYOUTS = [pytest.param(2, 2, id="gqa1"), pytest.param(4, 1, id="gqa4"), pytest.param(8, 1, id="gqa8")]


def _close(actual, expected, dtype):
    assert not actual.isnan().any(), "output has unwritten (NaN) elements"
    assert_close(actual, expected, dtype, scale=2.0)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("q_lens", [[1], [17, 1, 40]], ids=["single_token", "ragged"])
def test_varlen_causal_matches_reference(dtype, num_q_heads, num_kv_heads, q_lens):
    torch.manual_seed(len(q_lens) * 10 + num_q_heads)
    head_dim = 64
    total = sum(q_lens)
    q = randn(total, num_q_heads, head_dim, dtype=dtype)
    k = randn(total, num_kv_heads, head_dim, dtype=dtype)
    v = randn(total, num_kv_heads, head_dim, dtype=dtype)
    cu = cumulative(q_lens)
    out = poisoned(total, num_q_heads, head_dim, dtype=dtype)
    varlen_prefill_attention(q, k, v, cu, cu, head_dim**-0.5, out=out)
    _close(out, varlen_attention_reference(q, k, v, cu, cu, head_dim**-0.5), dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen_shorter_queries_align_bottom_right(causal):
    torch.manual_seed(3)
    q_lens, k_lens = [3, 20, 0], [30, 20, 5]
    q = randn(sum(q_lens), 4, 32, dtype=torch.float16)
    k = randn(sum(k_lens), 2, 32, dtype=torch.float16)
    v = randn(sum(k_lens), 2, 32, dtype=torch.float16)
    cu_q, cu_k = cumulative(q_lens), cumulative(k_lens)
    out = varlen_prefill_attention(q, k, v, cu_q, cu_k, 0.3, causal=causal)
    _close(out, varlen_attention_reference(q, k, v, cu_q, cu_k, 0.3, causal=causal), torch.float16)


def test_varlen_head_dim_128_long_prompt():
    torch.manual_seed(4)
    q_lens = [150]
    q = randn(150, 2, 128, dtype=torch.float16)
    k = randn(150, 1, 128, dtype=torch.float16)
    v = randn(150, 1, 128, dtype=torch.float16)
    cu = cumulative(q_lens)
    out = varlen_prefill_attention(q, k, v, cu, cu, 128**-0.5, max_query_len=150)
    _close(out, varlen_attention_reference(q, k, v, cu, cu, 128**-0.5), torch.float16)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_prefill_with_cached_prefix(dtype, num_q_heads, num_kv_heads, block_size):
    """Chunked prefill: new tokens after a cached prefix; contexts not multiples of the block size."""
    torch.manual_seed(block_size + num_q_heads)
    head_dim = 64
    seq_lens = [5, 33, 70, 1]
    q_lens = [5, 3, 20, 1]  # whole prompt, chunk after a prefix, longer chunk, single token
    cache = random_paged_cache(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype)
    cu_q = cumulative(q_lens)
    out = poisoned(*q.shape, dtype=dtype)
    paged_prefill_attention(
        q, cache.k_cache, cache.v_cache, cu_q, cache.seq_lens, cache.block_tables, 0.125, max(q_lens), out=out
    )
    expected = paged_prefill_attention_reference(
        q, cache.k_cache, cache.v_cache, cu_q, cache.seq_lens, cache.block_tables, 0.125
    )
    _close(out, expected, dtype)


# The float16-dot path does no bf16 arithmetic, so its bf16-query case runs in the interpreter too.
@pytest.mark.parametrize("dtype,via_float16", [
    pytest.param(torch.float16, True, id="fp16-f16dots"),
    pytest.param(torch.float16, False, id="fp16-upcast"),
    pytest.param(torch.bfloat16, True, id="bf16-f16dots"),
    pytest.param(torch.bfloat16, False, id="bf16-upcast", marks=pytest.mark.gpu),
])
def test_paged_prefill_reads_an_fp8_cache_with_per_head_scales(dtype, via_float16):
    """Both fp8 conversions: float16 dots (q converted once) and tiles upcast to q's dtype."""
    torch.manual_seed(9)
    seq_lens, q_lens = [40, 18], [8, 18]
    cache = random_paged_cache(seq_lens, 2, 64, 16, torch.float16)
    cache.k_cache = (cache.k_cache.float() / 0.03).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache.v_cache = (cache.v_cache.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = {"k_scale": torch.tensor([0.03, 0.05], device=DEVICE), "v_scale": torch.tensor([0.01, 0.02], device=DEVICE)}
    q = randn(sum(q_lens), 4, 64, dtype=dtype)
    if via_float16:
        q[3, 1, 5] = 2e5  # past float16's range: the kernel clamps it to 65504
    cu_q = cumulative(q_lens)
    args = (q, cache.k_cache, cache.v_cache, cu_q, cache.seq_lens, cache.block_tables, 0.125)
    out = paged_prefill_attention(*args, max(q_lens), fp8_via_float16=via_float16, **scales)
    clamped = (q.clamp(-65504, 65504), *args[1:])
    _close(out, paged_prefill_attention_reference(*clamped, **scales), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_prefill_long_prompts_gpu(head_dim, block_size):
    torch.manual_seed(head_dim + block_size)
    dtype = torch.bfloat16
    seq_lens = [2100, 1000, 333, 4097]
    q_lens = [2100, 999, 1, 1500]
    cache = random_paged_cache(seq_lens, 8, head_dim, block_size, dtype)
    q = randn(sum(q_lens), 32, head_dim, dtype=dtype)
    cu_q = cumulative(q_lens)
    out = poisoned(*q.shape, dtype=dtype)
    paged_prefill_attention(
        q, cache.k_cache, cache.v_cache, cu_q, cache.seq_lens, cache.block_tables, head_dim**-0.5, 2100, out=out
    )
    expected = paged_prefill_attention_reference(
        q, cache.k_cache, cache.v_cache, cu_q, cache.seq_lens, cache.block_tables, head_dim**-0.5
    )
    _close(out, expected, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("via_float16", [True, False], ids=["f16-dots", "upcast-to-q"])
def test_paged_prefill_long_prompts_over_an_fp8_cache_gpu(via_float16):
    """bf16 queries over an fp8 cache with per-head scales, both conversions, the compiled kernel."""
    torch.manual_seed(21)
    seq_lens, q_lens = [2100, 1000, 4097], [2100, 999, 1500]
    cache = random_paged_cache(seq_lens, 8, 128, 16, torch.bfloat16)
    scales = {"k_scale": torch.full((8,), 0.01, device=DEVICE), "v_scale": torch.full((8,), 0.02, device=DEVICE)}
    cache.k_cache = (cache.k_cache.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache.v_cache = (cache.v_cache.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = randn(sum(q_lens), 32, 128, dtype=torch.bfloat16)
    args = (q, cache.k_cache, cache.v_cache, cumulative(q_lens), cache.seq_lens, cache.block_tables, 128**-0.5)
    out = paged_prefill_attention(*args, max(q_lens), fp8_via_float16=via_float16, **scales)
    _close(out, paged_prefill_attention_reference(*args, **scales), torch.bfloat16)


@pytest.mark.gpu
def test_varlen_matches_sdpa_gpu():
    torch.manual_seed(11)
    q = randn(2048, 32, 128, dtype=torch.bfloat16)
    k = randn(2048, 8, 128, dtype=torch.bfloat16)
    v = randn(2048, 8, 128, dtype=torch.bfloat16)
    cu = cumulative([2048])
    out = varlen_prefill_attention(q, k, v, cu, cu, 128**-0.5, max_query_len=2048)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )[0].transpose(0, 1)
    _close(out, expected, torch.bfloat16)


def test_bad_input_raises_value_error():
    q = randn(4, 4, 64, dtype=torch.float16)
    k = randn(4, 3, 64, dtype=torch.float16)
    cu = cumulative([4])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        varlen_prefill_attention(q, k, k, cu, cu, 0.1)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        varlen_prefill_attention(randn(4, 4, 48, dtype=torch.float16), k, k, cu, cu, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q must have dtype"):
        varlen_prefill_attention(q, k[:, :2], k[:, :2], cu.long(), cu, 0.1)
    cache = random_paged_cache([4], 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="k_cache must have dtype"):
        paged_prefill_attention(
            q, cache.k_cache.float(), cache.v_cache, cu, cache.seq_lens, cache.block_tables, 0.1, 4
        )
    assert DEVICE.type in ("cpu", "cuda")


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_float32_queries_over_a_half_precision_cache_write_float32(dtype):
    """--activation-dtype float32: q in float32 is rounded to the cache's dtype for the dots (as a half-precision
    q would be) and the output stays float32, unrounded."""
    torch.manual_seed(3)
    seq_lens, q_lens = [9, 40], [9, 7]
    cache = random_paged_cache(seq_lens, 2, 64, 16, dtype)
    q = randn(sum(q_lens), 4, 64, dtype=torch.float32)
    cu_q = cumulative(q_lens)
    args = (cache.k_cache, cache.v_cache, cu_q, cache.seq_lens, cache.block_tables, 0.125, max(q_lens))
    out = paged_prefill_attention(q, *args, out=poisoned(*q.shape, dtype=torch.float32))
    rounded_q = paged_prefill_attention(q.to(dtype), *args, out=poisoned(*q.shape, dtype=torch.float32))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rounded_q, rtol=0, atol=0)
    expected = paged_prefill_attention_reference(q.to(dtype), cache.k_cache, cache.v_cache, cu_q, cache.seq_lens,
                                                 cache.block_tables, 0.125)
    _close(out.to(dtype), expected, dtype)
