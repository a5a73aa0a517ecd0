"""Decode attention (paged, split-KV) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from sits.kernels import attention_decode
from sits.kernels.attention_decode import (
    DEFAULT_FP8_VARIANT,
    FP8_DECODE_VARIANTS,
    SMALL_BATCH_FP8_VARIANT,
    choose_fp8_variant,
    paged_decode_attention,
    paged_decode_attention_reference,
    plan_decode_splits,
    split_tokens,
)
from sits.kernels.decode_schedules import FP8_VARIANT_ENV
from sits.kernels.decode_splits import SPLIT_GRANULE, SPLIT_TOKENS_ENV, kernel_split_tokens
from sits.kernels.decode_tiles import _round_to_e4m3
from sits.kernels.launch_utils import num_sms
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


@pytest.mark.parametrize("variant", sorted(FP8_DECODE_VARIANTS))
def test_fp8_variants_match_reference(variant):
    """Every inner-loop variant, with fixed schedules: tiles of one page gathered page by page (16)
    and of several pages (64), one split and three, a padding row, bf16 queries."""
    torch.manual_seed(6)
    cache, scales = _fp8_cache([50, 200, 0, 1, 128])  # partial tiles only, full tiles and a tail, none, exact
    q = randn(5, 8, 64, dtype=torch.bfloat16)
    for block_n, splits in ((64, 1), (16, 3)):
        out = _check(cache, q, 0.125, torch.bfloat16, num_splits=splits, fp8_variant=variant,
                     schedule=(block_n, 4, 2), **scales)
        assert out[2].abs().max() == 0


@pytest.mark.parametrize("variant", ["base_g", "swap_g", "swap_g_f", "swap_q8x2_p_f"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEAD_LAYOUTS)
def test_fp8_group_sized_rows_for_every_group(variant, num_q_heads, num_kv_heads):
    """The variants whose dots hold exactly the group's query heads (1, 4 and 8 rows here), or its
    two e4m3 terms side by side (8 + 8)."""
    torch.manual_seed(num_q_heads + num_kv_heads)
    cache = random_paged_cache([77, 20], num_kv_heads, 64, 16, torch.float16)
    cache.k_cache = (cache.k_cache.float() / 0.04).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache.v_cache = (cache.v_cache.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = {"k_scale": torch.full((num_kv_heads,), 0.04, device=DEVICE),
              "v_scale": torch.full((num_kv_heads,), 0.02, device=DEVICE)}
    q = randn(2, num_q_heads, 64, dtype=torch.float16)
    _check(cache, q, 0.125, torch.float16, num_splits=2, fp8_variant=variant, schedule=(32, 4, 2, 128), **scales)


def test_the_fp8_loop_follows_the_launch_shape(monkeypatch):
    """One split and at most two programs (sequences x KV heads) per multiprocessor: the small-batch loop;
    more programs or several splits: the default; SITS_FP8_DECODE_VARIANT names another for every launch."""
    monkeypatch.delenv(FP8_VARIANT_ENV, raising=False)
    sms = 132
    batch32 = plan_decode_splits(32, 8, 2048, sms)
    assert batch32.single
    assert choose_fp8_variant(batch32, 32, 8, sms) == SMALL_BATCH_FP8_VARIANT
    batch64 = plan_decode_splits(64, 8, 2048, sms)
    assert choose_fp8_variant(batch64, 64, 8, sms) == DEFAULT_FP8_VARIANT
    batch1 = plan_decode_splits(1, 8, 2048, sms)
    assert not batch1.single
    assert choose_fp8_variant(batch1, 1, 8, sms) == DEFAULT_FP8_VARIANT
    monkeypatch.setenv(FP8_VARIANT_ENV, "base")
    assert choose_fp8_variant(batch32, 32, 8, sms) == "base"
    monkeypatch.setenv(FP8_VARIANT_ENV, "fastest")
    with pytest.raises(ValueError, match="SITS_FP8_DECODE_VARIANT must be one of"):
        choose_fp8_variant(batch32, 32, 8, sms)


def test_split_tokens_follow_the_environment(monkeypatch):
    """Batch 1, 8 KV heads, 2,048 tokens on 132 multiprocessors: 256-token splits (8) by default; with
    SITS_DECODE_SPLIT_TOKENS=128, 16 splits of 128; under 128 the value is the granule too (32: 64 splits of 32
    tokens); a value off the 16-token quantum is refused."""
    monkeypatch.delenv(SPLIT_TOKENS_ENV, raising=False)
    plan = plan_decode_splits(1, 8, 2048, 132)
    assert (plan.num_splits, plan.tokens_per_split) == (8, 256)
    monkeypatch.setenv(SPLIT_TOKENS_ENV, "128")
    plan = plan_decode_splits(1, 8, 2048, 132)
    assert (plan.num_splits, plan.tokens_per_split) == (16, 128)
    assert plan_decode_splits(32, 8, 2048, 132).single  # a batch that fills the GPU stays unsplit
    monkeypatch.setenv(SPLIT_TOKENS_ENV, "32")
    plan = plan_decode_splits(1, 8, 2048, 132)
    assert (plan.num_splits, plan.tokens_per_split, plan.tokens_for(2048), plan.tokens_for(2000)) == (64, 32, 32, 32)
    monkeypatch.setenv(SPLIT_TOKENS_ENV, "100")
    with pytest.raises(ValueError, match="SITS_DECODE_SPLIT_TOKENS must be a positive multiple of 16"):
        plan_decode_splits(1, 8, 2048, 132)


@triton.jit
def _split_tokens_kernel(seq_lens_ptr, out_ptr, num_splits, min_tokens, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, kernel_split_tokens(tl.load(seq_lens_ptr + offs), num_splits, min_tokens))


def test_the_kernels_size_splits_as_the_host_says():
    """The kernels' split length per sequence (`kernel_split_tokens`) is `split_tokens`: its context over the launched
    splits, rounded up to the granule (128, or a shorter minimum), at least the minimum."""
    seq_lens = torch.tensor([0, 1, 127, 128, 129, 255, 256, 1000, 2048, 2049, 5000, 70_000, 131_072, 9, 300, 4096],
                            dtype=torch.int32, device=DEVICE)
    for num_splits in (1, 3, 10, 64):
        for min_tokens in (16, 32, 64, SPLIT_GRANULE, 256, 512):
            out = torch.empty_like(seq_lens)
            _split_tokens_kernel[(1,)](seq_lens, out, num_splits, min_tokens, N=seq_lens.numel())
            assert out.tolist() == [split_tokens(n, num_splits, min_tokens) for n in seq_lens.tolist()]


def test_a_short_context_under_a_wide_bound_still_spreads_over_the_splits(monkeypatch):
    """Batch 1, 8 KV heads, 132 multiprocessors, launched as CUDA graphs launch it: told that contexts reach a
    131,072-token table's width. 64 splits launch; a 2,048-token context fills 8 of them with 256 tokens each
    (as a launch told 2,048 does), not one split of 2,048 tokens. A context reaching the bound fills all 64, and
    no sequence ever fills more splits than launch or holds more tokens than the plan's longest split."""
    monkeypatch.delenv(SPLIT_TOKENS_ENV, raising=False)
    wide, tight = plan_decode_splits(1, 8, 131_072, 132), plan_decode_splits(1, 8, 2048, 132)
    assert (wide.num_splits, wide.tokens_per_split, wide.min_tokens) == (64, 2048, 256)
    assert wide.tokens_for(2048) == tight.tokens_for(2048) == 256
    assert wide.tokens_for(131_072) == 2048
    for max_context in (300, 2048, 2560, 4097, 131_072):
        plan = plan_decode_splits(1, 8, max_context, 132)
        for seq_len in range(1, max_context + 1, 37):
            tokens = plan.tokens_for(seq_len)
            assert -(-seq_len // tokens) <= plan.num_splits and (plan.single or tokens <= plan.tokens_per_split)
    assert plan_decode_splits(1, 8, 2048, 132, num_splits=16).tokens_for(2048) == 128  # a caller's count: 128


def test_splits_shorter_than_the_granule_match_the_reference(monkeypatch):
    """SITS_DECODE_SPLIT_TOKENS under 128 (32 and 16: splits shorter than some tiles, starting inside them) on
    16-token pages, automatic splits; on 64-token pages a 32-token split is refused, as its start could fall
    inside a page that one tile reads whole."""
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 132)
    torch.manual_seed(15)
    q = randn(3, 8, 64, dtype=torch.float16)
    for tokens in ("32", "16"):
        monkeypatch.setenv(SPLIT_TOKENS_ENV, tokens)
        cache = random_paged_cache([300, 37, 0], 2, 64, 16, torch.float16)
        _check(cache, q, 0.125, torch.float16)
        _check(cache, q, 0.125, torch.float16, schedule=(64, 4, 2))
    monkeypatch.setenv(SPLIT_TOKENS_ENV, "32")
    cache = random_paged_cache([300, 37, 0], 2, 64, 64, torch.float16)
    with pytest.raises(ValueError, match="SITS_DECODE_SPLIT_TOKENS=32 must be a multiple of the 64-token page"):
        paged_decode_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)


def test_short_contexts_under_a_wide_bound_match_the_reference(monkeypatch):
    """max_seq_len far past every context (the CUDA graphs' case), chosen splits (52 on 132 multiprocessors) and a
    caller's count: each row's splits are sized from its own length, the launched splits past them return, and the
    merge counts only those."""
    monkeypatch.delenv(SPLIT_TOKENS_ENV, raising=False)
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 132)
    torch.manual_seed(12)
    cache = random_paged_cache([300, 37, 0, 129, 1], 2, 64, 16, torch.float16)
    q = randn(5, 8, 64, dtype=torch.float16)
    for splits in (None, 24):
        _check(cache, q, 0.125, torch.float16, num_splits=splits, max_seq_len=1 << 16)


def test_an_fp8_launch_without_a_variant_runs_the_chosen_one(monkeypatch):
    """paged_decode_attention's default loop is choose_fp8_variant's: the same bits as naming it."""
    monkeypatch.delenv(FP8_VARIANT_ENV, raising=False)
    torch.manual_seed(8)
    cache, scales = _fp8_cache([90, 33])
    q = randn(2, 8, 64, dtype=torch.float16)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    sms = num_sms(q.device)
    plan = plan_decode_splits(2, cache.k_cache.shape[2], cache.block_tables.shape[1] * 16, sms, 1)
    chosen = choose_fp8_variant(plan, 2, cache.k_cache.shape[2], sms)
    assert chosen == SMALL_BATCH_FP8_VARIANT
    assert torch.equal(paged_decode_attention(*args, num_splits=1, **scales),
                       paged_decode_attention(*args, num_splits=1, fp8_variant=chosen, **scales))


@pytest.mark.parametrize("variant", ["swap_q8x2", "swap_q8x2_p_f"])
def test_fp8_two_term_queries_keep_small_components(variant):
    """q as two e4m3 terms under one per-head scale (two dots, or one over both side by side): a head
    whose elements span five decades (the small ones in e4m3's subnormal range) and a zero head match."""
    torch.manual_seed(7)
    cache, scales = _fp8_cache([90, 33])
    q = randn(2, 8, 64, dtype=torch.float16)
    q[0, 1] *= 1e-3
    q[0, 1, 5] = 80.0
    q[1, 6] = 0.0
    _check(cache, q, 0.125, torch.float16, fp8_variant=variant, **scales)


@triton.jit
def _round_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _round_to_e4m3(tl.load(x_ptr + offs)))


def test_round_to_e4m3_matches_torch_cast():
    """The integer rounding behind the two-term queries gives torch's e4m3 values (ties to even)
    across e4m3's normal range, its exact ties and its subnormal range (off its ties)."""
    torch.manual_seed(8)
    normal = torch.randn(512) * 60
    ties = torch.tensor([1.0625, 1.1875, -3.3125, 300.0, 17.0, 0.5078125])  # halfway between e4m3 neighbours
    subnormal = torch.linspace(-0.0155, 0.0155, 500)
    subnormal = subnormal[((subnormal * 512).frac().abs() - 0.5).abs() > 1e-3]
    x = torch.cat([normal.clamp(-448, 448), ties, subnormal, torch.zeros(1)])
    x = torch.cat([x, torch.zeros(2048 - x.numel())]).to(DEVICE)
    out = torch.empty_like(x)
    _round_kernel[(1,)](x, out, N=x.numel())
    torch.testing.assert_close(out, x.to(torch.float8_e4m3fn).float(), atol=0, rtol=0)


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
        scales = {"fp8_via_float16": via_float16, **_gpu_fp8(cache)}
    q = randn(len(seq_lens), 32, head_dim, dtype=torch.bfloat16)
    _check(cache, q, head_dim**-0.5, torch.bfloat16, **scales)
    _check(cache, q, head_dim**-0.5, torch.bfloat16, num_splits=1, **scales)


def _gpu_fp8(cache):
    """Quantizes the cache to fp8 in place (scales 0.01 / 0.02); returns the scale kwargs."""
    cache.k_cache = (cache.k_cache.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache.v_cache = (cache.v_cache.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"k_scale": torch.full((8,), 0.01, device=DEVICE), "v_scale": torch.full((8,), 0.02, device=DEVICE)}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", sorted(set(FP8_DECODE_VARIANTS) - {"base"}))
def test_fp8_variants_long_contexts_gpu(head_dim, variant):
    """Each fp8 variant compiled for the GPU (wgmma where it applies) at one deep schedule, split and not."""
    torch.manual_seed(head_dim)
    seq_lens = [8191, 1, 2048, 0, 5000, 33]
    cache = random_paged_cache(seq_lens, 8, head_dim, 16, torch.bfloat16)
    scales = _gpu_fp8(cache)
    q = randn(len(seq_lens), 32, head_dim, dtype=torch.bfloat16)
    for splits in (None, 1):
        _check(cache, q, head_dim**-0.5, torch.bfloat16, fp8_variant=variant, schedule=(64, 4, 10),
               num_splits=splits, **scales)


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
    fp8_cache, scales = _fp8_cache([4])
    args = (q, fp8_cache.k_cache, fp8_cache.v_cache, fp8_cache.block_tables, fp8_cache.seq_lens, 0.1)
    with pytest.raises(ValueError, match="fp8_variant must be one of"):
        paged_decode_attention(*args, fp8_variant="nope", **scales)
    with pytest.raises(ValueError, match="needs fp8_via_float16=True"):
        paged_decode_attention(*args, fp8_variant="swap", fp8_via_float16=False, **scales)
    with pytest.raises(ValueError, match="schedule BLOCK_N must be"):
        paged_decode_attention(*args, schedule=(48, 4, 2), **scales)
    with pytest.raises(ValueError, match="schedule must be"):
        paged_decode_attention(*args, schedule=(64, 4), **scales)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton compiles, and specializes, only on a GPU")
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "fused-rope"])
def test_decode_rows_after_prefills_reuse_the_decode_only_binary(rope):
    """A mixed step's decode rows are views that start after its prefills (seq_lens at a 4-byte offset, the
    tables a row further): the launch must run the binary a decode-only step compiled, not a new one."""
    from sits.kernels.attention_decode import DecodeRope, _decode_split_kernel
    from sits.kernels.rope_kv_write import build_cos_sin_cache

    torch.manual_seed(5)
    cache = random_paged_cache([7, 300, 129, 64, 1000], 2, 64, 16, torch.bfloat16)
    qkv = randn(5, 12 * 64, dtype=torch.bfloat16)
    q, k, v = (t.reshape(5, -1, 64) for t in qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1))
    table = build_cos_sin_cache(64, 2048, device=DEVICE)
    positions = (cache.seq_lens.long() - 1).clamp(min=0)
    slots = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)  # nothing written: both launches alike

    def launch(rows: slice) -> None:
        fused = DecodeRope(k[rows], v[rows], positions[rows], table, slots[rows]) if rope else None
        paged_decode_attention(q[rows], cache.k_cache, cache.v_cache, cache.block_tables[rows], cache.seq_lens[rows],
                               0.125, num_splits=3, schedule=(64, 4, 4), rope=fused)

    def binaries() -> int:
        return sum(len(caches[0]) for caches in _decode_split_kernel.fn.device_caches.values())

    launch(slice(0, 4))  # a decode-only step: every view starts at its tensor's start
    torch.cuda.synchronize()
    compiled = binaries()
    launch(slice(1, 5))  # the decodes of a step with one prefill before them
    torch.cuda.synchronize()
    assert binaries() == compiled
