"""Fused RoPE + KV-cache write against the PyTorch reference, and the cos/sin table against HF."""

from __future__ import annotations

import pytest
import torch

from sits.kernels.rope_kv_write import (
    build_cos_sin_cache,
    rope_and_cache_write,
    rope_and_cache_write_reference,
)
from tests.kernels.helpers import DEVICE, HALF_DTYPES, assert_close, randn

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _case(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype=None, num_blocks=12):
    q = randn(num_tokens, num_q_heads, head_dim, dtype=dtype)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = randn(*cache_shape, dtype=dtype).to(cache_dtype or dtype)
    v_cache = randn(*cache_shape, dtype=dtype).to(cache_dtype or dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEVICE)
    return q, k, v, k_cache, v_cache, slots


def _run_both(q, k, v, positions, table, k_cache, v_cache, slots, **scales):
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = rope_and_cache_write_reference(q, k, v, positions, table, ref_k_cache, ref_v_cache, slots, **scales)
    q_out, k_out = rope_and_cache_write(q, k, v, positions, table, k_cache, v_cache, slots, **scales)
    return (q_out, k_out, k_cache, v_cache), (ref_q, ref_k, ref_k_cache, ref_v_cache)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_q_heads,num_kv_heads,head_dim,block_size",
    [(1, 4, 4, 64, 16), (9, 8, 2, 64, 16), (13, 16, 2, 128, 64), (5, 9, 3, 64, 16)],
)
def test_rotates_in_place_and_writes_cache(dtype, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size):
    torch.manual_seed(num_tokens)
    q, k, v, k_cache, v_cache, slots = _case(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    table = build_cos_sin_cache(head_dim, 4096, 500000.0, LLAMA3_SCALING, device=DEVICE)
    positions = torch.randint(0, 4096, (num_tokens,)).to(DEVICE)
    got, want = _run_both(q, k, v, positions, table, k_cache, v_cache, slots)
    assert got[0] is q and got[1] is k  # rotated in place
    for actual, expected in zip(got, want, strict=True):
        assert_close(actual, expected)


def test_slot_minus_one_skips_the_write_and_partial_rotary_keeps_the_tail():
    torch.manual_seed(5)
    q, k, v, k_cache, v_cache, slots = _case(6, 4, 2, 64, 16, torch.float16)
    slots[1] = -1
    slots[4] = -1
    k_tail_before = k[..., 32:].clone()
    table = build_cos_sin_cache(32, 100, 10000.0, device=DEVICE)  # rotary_dim 32 of head_dim 64
    positions = torch.arange(6, dtype=torch.int32, device=DEVICE) * 7
    untouched_before = k_cache.clone()
    got, want = _run_both(q, k, v, positions, table, k_cache, v_cache, slots)
    for actual, expected in zip(got, want, strict=True):
        assert_close(actual, expected)
    torch.testing.assert_close(k[..., 32:], k_tail_before, atol=0, rtol=0)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEVICE).view(-1)
    written[slots[slots >= 0]] = True
    torch.testing.assert_close(k_cache.view(-1, 2, 64)[~written], untouched_before.view(-1, 2, 64)[~written])


@pytest.mark.gpu
def test_fp8_cache_stores_scaled_values():
    torch.manual_seed(6)
    q, k, v, k_cache, v_cache, slots = _case(17, 8, 2, 128, 16, torch.bfloat16, cache_dtype=torch.float8_e4m3fn)
    table = build_cos_sin_cache(128, 2048, 500000.0, device=DEVICE)
    positions = torch.randint(0, 2048, (17,)).to(DEVICE)
    scales = {
        "k_scale": torch.tensor([0.01, 0.02], device=DEVICE),
        "v_scale": torch.tensor([0.03, 0.005], device=DEVICE),
    }
    got, want = _run_both(q, k, v, positions, table, k_cache, v_cache, slots, **scales)
    assert_close(got[0], want[0])
    for actual, expected in zip(got[2:], want[2:], strict=True):
        # One e4m3 rounding step (3 mantissa bits) where the GPU's division rounds differently.
        torch.testing.assert_close(actual.float(), expected.float(), atol=2**-9, rtol=0.125)


def test_cos_sin_table_matches_transformers_llama3():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING),
    )  # fmt: skip
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 1, 128), torch.arange(9000)[None])
    table = build_cos_sin_cache(128, 9000, 500000.0, LLAMA3_SCALING)
    torch.testing.assert_close(table[:, :64], cos[0, :, :64], atol=0, rtol=0)
    torch.testing.assert_close(table[:, 64:], sin[0, :, :64], atol=0, rtol=0)


def test_bad_input_raises_value_error():
    q, k, v, k_cache, v_cache, slots = _case(3, 4, 2, 64, 16, torch.float16)
    table = build_cos_sin_cache(64, 16, device=DEVICE)
    positions = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache must be"):
        rope_and_cache_write(q, k, v, positions, table, k_cache[:, :, :1], v_cache, slots)
    with pytest.raises(ValueError, match="positions must have dtype"):
        rope_and_cache_write(q, k, v, positions.float(), table, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_and_cache_write(q, k, v, positions, build_cos_sin_cache(128, 16, device=DEVICE), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="rope_type"):
        build_cos_sin_cache(64, 16, rope_scaling={"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("cache_dtype", HALF_DTYPES)
def test_float32_q_k_v_write_a_half_precision_cache(cache_dtype):
    """--activation-dtype float32: q and k rotate in float32 (unrounded) and k, v are rounded to the half-precision
    cache as they are stored, as the reference stores them."""
    torch.manual_seed(11)
    q, k, v, k_cache, v_cache, slots = _case(7, 8, 2, 64, 16, torch.float32, cache_dtype=cache_dtype)
    table = build_cos_sin_cache(64, 4096, 10000.0, None, device=DEVICE)
    positions = torch.randint(0, 4096, (7,)).to(DEVICE)
    got, want = _run_both(q, k, v, positions, table, k_cache, v_cache, slots)
    assert got[0].dtype == torch.float32 and got[2].dtype == cache_dtype
    for actual, expected in zip(got, want, strict=True):
        assert_close(actual, expected)


def test_a_half_precision_q_cannot_write_a_cache_of_another_dtype():
    q, k, v, k_cache, v_cache, slots = _case(2, 4, 2, 64, 16, torch.bfloat16, cache_dtype=torch.float16)
    table = build_cos_sin_cache(64, 64, 10000.0, None, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache"):
        rope_and_cache_write(q, k, v, torch.zeros(2, dtype=torch.int64, device=DEVICE), table, k_cache, v_cache, slots)
