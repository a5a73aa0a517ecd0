"""The torch reference attention back end against dense attention, RoPE against transformers, and
the back-end registry."""

from __future__ import annotations

import logging

import pytest
import torch

from sits.runtime.attention.backend import AttentionBackend
from sits.runtime.attention.registry import (
    BackendUnavailableError,
    register_backend,
    select_backend,
    unregister_backend,
)
from sits.runtime.attention.torch_plan import GROUP_OVERHEAD_TOKENS, group_by_context
from sits.runtime.attention.torch_ref import TorchAttentionBackend, write_kv_cache
from sits.runtime.models.rotary import apply_rotary, build_cos_sin_cache, rope_inverse_frequencies
from tests.support.model_driver import PagedKVCache, PagedSequence, build_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


class _CacheHolder:
    """Just enough of a model for PagedKVCache: one layer of the given attention shape."""

    def __init__(self, dtype, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=1):
        from sits.runtime.models.config import LlamaConfig

        self.config = LlamaConfig(vocab_size=8, hidden_size=heads * head_dim, intermediate_size=8,
                                  num_hidden_layers=layers, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, head_dim=head_dim)
        self._param = torch.zeros(1, dtype=dtype)

    def parameters(self):
        return iter([self._param])

    def kv_cache_shape(self, num_blocks, block_size):
        return self.config.kv_cache_shape(num_blocks, block_size)


def dense_reference(q, keys, values, first_position):
    """float64 softmax attention with an explicit causal mask; q [n, H, D], keys/values [L, KV, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), k) * q.shape[-1] ** -0.5
    query_pos = torch.arange(q.shape[0])[:, None] + first_position
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_matches_dense_attention(dtype):
    """Two prefills (one fresh, one after a cached prefix) and three decodes in one flat batch."""
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(_CacheHolder(dtype), num_blocks=40, block_size=BLOCK)
    k_cache, v_cache = cache.caches[0]
    # (context already cached, new tokens): prefills first, then decodes
    layout = [(0, 7), (5, 6), (8, 1), (12, 1), (1, 1)]
    seqs, full_kv = [], []
    for cached, new in layout:
        seq = PagedSequence(list(range(cached + new)))
        keys = torch.randn(cached + new, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        values = torch.randn(cached + new, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        if cached:  # the prefix an earlier step wrote
            cache.ensure_capacity(seq, cached)
            slots = torch.tensor([cache.slot(seq, p) for p in range(cached)])
            write_kv_cache(keys[:cached], values[:cached], k_cache, v_cache, slots)
            seq.num_cached = cached
        seqs.append(seq)
        full_kv.append((keys, values))
    positions, metadata, _ = build_metadata(cache, [(s, new) for s, (_, new) in zip(seqs, layout, strict=True)], torch.device("cpu"))
    assert (metadata.num_prefills, metadata.num_decodes) == (2, 3)
    new_k = torch.cat([k[c:] for (k, _), (c, _) in zip(full_kv, layout, strict=True)])
    new_v = torch.cat([v[c:] for (_, v), (c, _) in zip(full_kv, layout, strict=True)])
    q = torch.randn(metadata.num_tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    write_kv_cache(new_k, new_v, k_cache, v_cache, metadata.slot_mapping)

    out = TorchAttentionBackend().forward(q, new_k, new_v, k_cache, v_cache, metadata, HEAD_DIM**-0.5)

    assert out.dtype == dtype and out.shape == q.shape
    row = 0
    for (keys, values), (cached, new) in zip(full_kv, layout, strict=True):
        expected = dense_reference(q[row:row + new], keys, values, cached)
        torch.testing.assert_close(out[row:row + new].double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        row += new


def test_long_prompt_matches_dense_attention():
    """A 700-token prompt (a causal call of its own, its new k and v as the context)."""
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(_CacheHolder(torch.float32), num_blocks=200, block_size=8)
    seq = PagedSequence(list(range(700)))
    positions, metadata, _ = build_metadata(cache, [(seq, 700)], torch.device("cpu"))
    k = torch.randn(700, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(700, KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(700, HEADS, HEAD_DIM, generator=gen)
    write_kv_cache(k, v, *cache.caches[0], metadata.slot_mapping)
    out = TorchAttentionBackend().forward(q, k, v, *cache.caches[0], metadata, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, 0), atol=1e-5, rtol=1e-5)


class _RaggedStep:
    """One step over a paged cache: sequences given as (tokens already cached, new tokens), prefills
    first, and the dense float64 attention each sequence's new tokens should get."""

    def __init__(self, layout, heads, kv_heads, head_dim, block_size, dtype=torch.float32, layers=1, seed=0):
        gen = torch.Generator().manual_seed(seed)
        holder = _CacheHolder(dtype, heads, kv_heads, head_dim, layers)
        blocks = sum(-(-(cached + new) // block_size) for cached, new in layout) + 1
        self.cache = PagedKVCache(holder, num_blocks=blocks, block_size=block_size)
        self.layout, self.dtype, self.head_dim = layout, dtype, head_dim
        seqs = []
        for cached, _ in layout:
            seq = PagedSequence(list(range(cached + 1)))
            self.cache.ensure_capacity(seq, cached)
            seq.num_cached = cached
            seqs.append(seq)
        _, self.metadata, _ = build_metadata(self.cache, [(s, n) for s, (_, n) in zip(seqs, layout, strict=True)],
                                             torch.device("cpu"))
        self.layers = []
        for k_cache, v_cache in self.cache.caches:
            context = [(torch.randn(c + n, kv_heads, head_dim, generator=gen).to(dtype),
                        torch.randn(c + n, kv_heads, head_dim, generator=gen).to(dtype)) for c, n in layout]
            for seq, (cached, _), (keys, values) in zip(seqs, layout, context, strict=True):  # written by earlier steps
                slots = torch.tensor([self.cache.slot(seq, p) for p in range(cached)], dtype=torch.int64)
                write_kv_cache(keys[:cached], values[:cached], k_cache, v_cache, slots)
            new_k = torch.cat([k[c:] for (k, _), (c, _) in zip(context, layout, strict=True)])
            new_v = torch.cat([v[c:] for (_, v), (c, _) in zip(context, layout, strict=True)])
            q = torch.randn(self.metadata.num_tokens, heads, head_dim, generator=gen).to(dtype)
            write_kv_cache(new_k, new_v, k_cache, v_cache, self.metadata.slot_mapping)
            self.layers.append((q, new_k, new_v, k_cache, v_cache, context))

    def run(self, layer=0, backend=None):
        q, new_k, new_v, k_cache, v_cache, _ = self.layers[layer]
        backend = backend or TorchAttentionBackend()
        return backend.forward(q, new_k, new_v, k_cache, v_cache, self.metadata, self.head_dim**-0.5)

    def assert_matches_dense(self, out, layer=0):
        q, *_, context = self.layers[layer]
        assert out.dtype == self.dtype and out.shape == q.shape
        row = 0
        for (keys, values), (cached, new) in zip(context, self.layout, strict=True):
            expected = dense_reference(q[row:row + new], keys, values, cached)
            tolerance = TOLERANCE[self.dtype]
            torch.testing.assert_close(out[row:row + new].double(), expected, atol=tolerance, rtol=tolerance,
                                       msg=lambda m, c=cached, n=new: f"sequence ({c} cached, {n} new): {m}")
            row += new


# Prefills (fresh prompts of 5, 9, 150 and 1 tokens, the 150 long enough for a call of its own;
# chunked prefills of 6 and 140 tokens after a cached prefix) then decodes whose contexts spread
# over several padded groups.
RAGGED_LAYOUT = [(0, 5), (0, 9), (0, 150), (37, 6), (200, 140), (0, 1),
                 (64, 1), (3, 1), (40, 1), (41, 1), (90, 1), (250, 1), (251, 1), (600, 1), (17, 1)]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 16), (4, 4, 32)])
def test_ragged_batch_matches_per_sequence_attention(block_size, heads, kv_heads, head_dim):
    """SmolLM2's 9/3-head GQA, multi-query and plain multi-head attention, two block sizes."""
    step = _RaggedStep(RAGGED_LAYOUT, heads, kv_heads, head_dim, block_size)
    step.assert_matches_dense(step.run())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ragged_batch_in_half_precision(dtype):
    step = _RaggedStep(RAGGED_LAYOUT, 9, 3, 64, 16, dtype=dtype, seed=3)
    step.assert_matches_dense(step.run())


def test_decodes_of_many_context_lengths_in_one_step():
    """64 decodes with contexts from 1 to 2,000 tokens (several groups, most of them padded)."""
    lengths = torch.randint(1, 2001, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    step = _RaggedStep([(length - 1, 1) for length in lengths], 9, 3, 64, 16, seed=5)
    assert len(group_by_context(lengths)) > 1
    step.assert_matches_dense(step.run())


def test_layers_of_one_step_share_the_plan_and_keep_their_results():
    """Each layer's output stays correct after later layers of the same step reuse the gather buffers."""
    step = _RaggedStep(RAGGED_LAYOUT, 9, 3, 64, 16, layers=3, seed=7)
    backend = TorchAttentionBackend()
    outs = [step.run(layer, backend) for layer in range(3)]
    for layer, out in enumerate(outs):
        step.assert_matches_dense(out, layer)


def test_padding_rows_after_the_batch_are_zero():
    """q may carry padding rows past metadata.num_tokens (a padded batch): they come back zero."""
    step = _RaggedStep([(10, 1), (30, 1)], 4, 2, 16, 16)
    q, new_k, new_v, k_cache, v_cache, _ = step.layers[0]
    padded_q = torch.cat([q, torch.randn(3, 4, 16)])
    out = TorchAttentionBackend().forward(padded_q, new_k, new_v, k_cache, v_cache, step.metadata, 16**-0.5)
    assert out.shape == padded_q.shape and not out[2:].any()
    step.assert_matches_dense(out[:2])


def test_grouping_covers_every_sequence_once_and_bounds_padding():
    lengths = [5, 2000, 1900, 100, 101, 990, 1000, 1, 1500, 30]
    groups = group_by_context(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:  # a sequence shares a group only with contexts it is not dwarfed by
        longest = max(lengths[i] for i in group)
        padding = sum(longest - lengths[i] for i in group)
        assert padding <= GROUP_OVERHEAD_TOKENS or min(lengths[i] for i in group) >= 0.9 * longest
    assert group_by_context([7, 9, 8]) == [[0, 1, 2]]  # one group keeps batch order
    assert group_by_context([]) == []


def test_rope_and_cache_write_rotates_and_skips_padding():
    gen = torch.Generator().manual_seed(2)
    table = build_cos_sin_cache(HEAD_DIM, 64, 10000.0)
    q = torch.randn(3, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(3, KV_HEADS, HEAD_DIM, generator=gen)
    k_cache = torch.zeros(4, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.tensor([0, 5, 9])
    slots = torch.tensor([13, -1, 2])  # the middle token is padding
    q_rot, k_rot = TorchAttentionBackend().rope_and_cache_write(q, k, v, positions, table, k_cache, v_cache, slots)

    torch.testing.assert_close(q_rot, apply_rotary(q, positions, table))
    torch.testing.assert_close(q_rot[0], q[0])  # position 0 does not rotate
    flat_k, flat_v = k_cache.view(-1, KV_HEADS, HEAD_DIM), v_cache.view(-1, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat_k[13], k_rot[0])
    torch.testing.assert_close(flat_k[2], k_rot[2])
    torch.testing.assert_close(flat_v[2], v[2])
    assert int((flat_k.abs().sum(dim=(1, 2)) > 0).sum()) == 2  # nothing else was written


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_matches_transformers(rope_scaling):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = {"rope_type": "default", "rope_theta": 500000.0, **(rope_scaling or {})}
    hf_config = HFLlamaConfig(hidden_size=HEADS * 32, num_attention_heads=HEADS, max_position_embeddings=256,
                              rope_parameters=params)
    positions = torch.tensor([0, 1, 17, 100, 255])
    x = torch.randn(1, HEADS, len(positions), 32, generator=torch.Generator().manual_seed(3))
    cos, sin = LlamaRotaryEmbedding(hf_config)(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)

    table = build_cos_sin_cache(32, 256, 500000.0, rope_scaling)
    ours = apply_rotary(x[0].transpose(0, 1), positions, table).transpose(0, 1)
    torch.testing.assert_close(ours, expected[0], atol=1e-6, rtol=1e-6)


def test_gguf_frequency_factors_give_the_llama3_table():
    """GGUF stores Llama 3.1's scaling as one divisor per frequency; both spellings give one table."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    plain = rope_inverse_frequencies(32, 500000.0)
    factors = (plain / rope_inverse_frequencies(32, 500000.0, llama3)).tolist()
    torch.testing.assert_close(build_cos_sin_cache(32, 256, 500000.0, {"rope_type": "freq_factors", "factors": factors}),
                               build_cos_sin_cache(32, 256, 500000.0, llama3), atol=1e-5, rtol=1e-5)


def test_a_table_for_the_meta_device_has_the_real_shape_and_still_checks_its_arguments():
    """A model built on the meta device gets a meta table (no values to compute) shaped as the real one."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    real = build_cos_sin_cache(32, 256, 500000.0, llama3)
    for explicit in (True, False):
        with torch.device("meta"):
            table = build_cos_sin_cache(32, 256, 500000.0, llama3, device="meta" if explicit else None)
        assert table.device.type == "meta" and table.shape == real.shape and table.dtype == real.dtype
    with torch.device("meta"), pytest.raises(ValueError, match="freq_factors needs 16 factors"):
        build_cos_sin_cache(32, 256, 500000.0, {"rope_type": "freq_factors", "factors": [1.0, 2.0]})
    with pytest.raises(ValueError, match="rotary_dim"):
        build_cos_sin_cache(31, 256, 10000.0, device="meta")


# -- registry --------------------------------------------------------------------------------------


def test_auto_picks_the_torch_back_end_on_cpu_and_logs_why(caplog):
    with caplog.at_level(logging.INFO, logger="sits.runtime.attention.registry"):
        backend = select_backend("auto", "cpu", torch.float32, 64)
    assert isinstance(backend, TorchAttentionBackend)
    assert "attention back end: torch (auto" in caplog.text
    assert isinstance(select_backend("torch", torch.device("cpu"), torch.bfloat16, 80), TorchAttentionBackend)


def test_unknown_back_end_is_a_clear_error():
    with pytest.raises(BackendUnavailableError, match="'flash' is not available.*available: .*torch"):
        select_backend("flash", "cpu", torch.float32, 64)


class _GpuOnlyBackend(TorchAttentionBackend):
    name = "test-gpu-only"
    priority = 100

    @classmethod
    def unsupported_reason(cls, device, dtype, head_dim):
        return None if device.type == "cuda" else "needs a CUDA device"


class _PreferredBackend(TorchAttentionBackend):
    name = "test-preferred"
    priority = 50


def test_a_registered_back_end_takes_part_by_priority(caplog):
    register_backend(_GpuOnlyBackend)
    try:
        with caplog.at_level(logging.INFO, logger="sits.runtime.attention.registry"):
            assert type(select_backend("auto", "cpu", torch.float32, 64)) is TorchAttentionBackend
        assert "test-gpu-only: needs a CUDA device" in caplog.text
        with pytest.raises(BackendUnavailableError, match="cannot run cpu/float32/head_dim 64: needs a CUDA device"):
            select_backend("test-gpu-only", "cpu", torch.float32, 64)
        register_backend(_PreferredBackend)
        assert type(select_backend("auto", "cpu", torch.float32, 64)) is _PreferredBackend
    finally:
        unregister_backend(_GpuOnlyBackend.name)
        unregister_backend(_PreferredBackend.name)
    assert issubclass(TorchAttentionBackend, AttentionBackend)
