"""The decode split kernel's inner-loop variants over a bf16 / fp16 cache (HALF_DECODE_VARIANTS, half_variant= or
SITS_DECODE_VARIANT): each against the PyTorch reference, with several splits and the split kernel's own merge,
the RoPE + KV write fused in (bit for bit the two launches of the same variant), and a float32 query.

On a CPU these run through Triton's interpreter in float16 (its bf16 arithmetic is not the GPU's); the `gpu`
case runs bf16 at a Llama-3-8B head layout.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels.attention_decode import (
    DEFAULT_HALF_VARIANT,
    FP8_DECODE_VARIANTS,
    HALF_DECODE_VARIANTS,
    choose_half_variant,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from sits.kernels.decode_schedules import HALF_VARIANT_ENV
from tests.kernels.helpers import DEVICE, assert_close, poisoned, randn
from tests.kernels.paged import random_paged_cache
from tests.kernels.test_attention_decode_rope import assert_same_bits, decode_step, fused, two_launches

VARIANTS = sorted(HALF_DECODE_VARIANTS)
# Ragged contexts, a single token, a padding row, and one long enough for several 128-token tiles per split.
SEQ_LENS = [1, 37, 0, 300, 129, 16]


def _attend(cache, q, **kwargs) -> torch.Tensor:
    out = poisoned(*q.shape, dtype=q.dtype)
    return paged_decode_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125,
                                  out=out, **kwargs)


def test_the_half_variants_are_the_fp8_loops_that_take_tiles_as_stored():
    assert DEFAULT_HALF_VARIANT == "base"  # what the half caches ran before the variants were offered
    assert {"base", "base_f", "base_g_f", "swap_g_f", "k_t"} <= set(VARIANTS)
    assert not {"swap_q8x2", "swap_q8x2_f", "swap_q8x2_p_f"} & set(VARIANTS)  # q as e4m3 terms: fp8 caches only
    assert all(HALF_DECODE_VARIANTS[name] == FP8_DECODE_VARIANTS[name] for name in VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 2), (6, 2)], ids=["gqa4", "gqa3"])
@pytest.mark.parametrize("splits,merge", [(1, False), (3, False), (3, True)], ids=["1split", "3splits", "3fused"])
def test_each_variant_matches_the_reference(variant, num_q_heads, num_kv_heads, splits, merge):
    torch.manual_seed(len(variant) + num_q_heads + splits)
    cache = random_paged_cache(SEQ_LENS, num_kv_heads, 64, 16, torch.float16)
    q = randn(len(SEQ_LENS), num_q_heads, 64, dtype=torch.float16)
    kwargs = {"num_splits": splits, "half_variant": variant}
    if merge:
        kwargs["split_counters"] = torch.zeros(len(SEQ_LENS) * num_kv_heads, dtype=torch.int32, device=DEVICE)
    out = _attend(cache, q, **kwargs)
    expected = paged_decode_attention_reference(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens,
                                                0.125)
    assert not out.isnan().any(), "output rows left unwritten"
    assert_close(out, expected, torch.float16, scale=2.0)
    assert out[2].abs().max() == 0  # the padding row
    if merge:
        assert kwargs["split_counters"].count_nonzero() == 0, "the fused merge left counters set"


@pytest.mark.parametrize("variant", ["base_f", "base_g_f", "swap_g_f"])
def test_fused_rope_is_bit_identical_in_each_variant(variant):
    """The fused RoPE + KV write against rope_and_cache_write then the same variant's launch."""
    torch.manual_seed(11)
    step = decode_step([17, 0, 64, 1, 300, 65], 8, 2, 16, torch.float16, torch.float16)
    for splits in (1, 3):
        got = fused(step, num_splits=splits, half_variant=variant)
        assert_same_bits(got, two_launches(step, num_splits=splits, half_variant=variant), step)


@pytest.mark.parametrize("variant", ["base_g_f", "swap_g_f"])
def test_float32_query_in_each_variant(variant):
    """A float32 q (float32 activations) over a float16 cache: q and P as two float16 terms each keep the
    result within float32 rounding of attention on the float32 q, far closer than a float16 q gets."""
    torch.manual_seed(12)
    cache = random_paged_cache(SEQ_LENS, 2, 64, 16, torch.float16)
    q = randn(len(SEQ_LENS), 8, 64, dtype=torch.float32)
    out = _attend(cache, q, num_splits=3, half_variant=variant)
    args = (cache.k_cache.double(), cache.v_cache.double(), cache.block_tables, cache.seq_lens, 0.125)
    exact = paged_decode_attention_reference(q.double(), *args)
    rounded_q = _attend(cache, q.half(), num_splits=3, half_variant=variant).double()
    error, half_error = (out.double() - exact).abs().max(), (rounded_q - exact).abs().max()
    assert error < 1e-5 and error * 50 < half_error, (error, half_error)


def test_the_environment_picks_the_variant_and_a_bad_name_is_a_clear_error(monkeypatch):
    torch.manual_seed(13)
    cache = random_paged_cache([40, 9], 2, 64, 16, torch.float16)
    q = randn(2, 4, 64, dtype=torch.float16)
    monkeypatch.setenv(HALF_VARIANT_ENV, "swap_g_f")
    assert choose_half_variant() == "swap_g_f"
    forced = _attend(cache, q, num_splits=2)
    assert torch.equal(forced, _attend(cache, q, num_splits=2, half_variant="swap_g_f"))
    monkeypatch.setenv(HALF_VARIANT_ENV, "swap_q8x2")
    with pytest.raises(ValueError, match=f"{HALF_VARIANT_ENV} must be one of"):
        _attend(cache, q)
    monkeypatch.delenv(HALF_VARIANT_ENV)
    assert choose_half_variant() == DEFAULT_HALF_VARIANT
    with pytest.raises(ValueError, match="half_variant must be one of"):
        _attend(cache, q, half_variant="nope")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_in_bf16_at_the_llama_layout(variant):
    """bf16, 32 query / 8 KV heads: one split at batch 32 and several at batch 1, the RoPE fused."""
    torch.manual_seed(14)
    for seq_lens in ([2049], [300, 0, 2048, 17] * 8):
        step = decode_step(seq_lens, 32, 8, 16, torch.bfloat16, torch.bfloat16)
        got = fused(step, half_variant=variant)
        assert_same_bits(got, two_launches(step, half_variant=variant), step)
