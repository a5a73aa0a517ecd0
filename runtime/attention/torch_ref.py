"""The reference attention back end: plain PyTorch, any device, any dtype.

It is the CPU back end and the ground truth the Triton kernels are tested against. Attention is
`torch.nn.functional.scaled_dot_product_attention`, in float32 whatever the model's dtype (so
half-precision models keep float32 scores, softmax and products, and on a CPU no whole score
matrix is ever materialised); K/V are read through the block tables exactly as a paged kernel reads
them. What every layer of a step shares (rows to gather, masks, the grouping of sequences, the
gather buffers) is worked out once per step: see `torch_plan.py`, which also gives the layouts.

Per layer: decodes and short prefills go in a few padded groups of similar context length, one
call each, whatever the batch size; a long prefill gets a call of its own, causal (its new k and v
are its context) or masked after a cached prefix (its context is read from the cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sits.runtime.attention.backend import AttentionBackend, AttentionMetadata
from sits.runtime.attention.registry import register_backend
from sits.runtime.attention.torch_plan import LongPrefill, PaddedGroup, StepPlan, step_plan
from sits.runtime.models.rotary import apply_rotary


@register_backend
class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch (CPU and CUDA, float32 / float16 / bfloat16, any head size)."""

    name = "torch"
    version = "2"
    priority = 0

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        return None

    def rope_and_cache_write(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
        """See AttentionBackend.rope_and_cache_write; returns new rotated tensors (inputs untouched)."""
        q = apply_rotary(q, positions, cos_sin_cache)
        k = apply_rotary(k, positions, cos_sin_cache)
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return q, k

    def forward(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """See AttentionBackend.forward. Rows past metadata.num_tokens (padding) are left zero."""
        num_rows, heads, head_dim = q.shape  # num_rows >= metadata.num_tokens (a batch may be padded)
        plan = step_plan(metadata, k_cache, heads // k_cache.shape[2])
        out = q.new_empty(q.shape)
        out[metadata.num_tokens:] = 0
        for prefill in plan.long_prefills:
            rows = slice(prefill.first_row, prefill.first_row + prefill.query_len)
            out[rows] = _attend_long_prefill(q[rows], k[rows], v[rows], k_cache, v_cache, plan, prefill, scale)
        if plan.groups:
            # Both viewed [num_rows * kv_heads, group * head_dim]: a row is one KV head's query heads.
            q_rows = q.reshape(num_rows * plan.kv_heads, plan.group * head_dim)
            out_rows = out.view(num_rows * plan.kv_heads, plan.group * head_dim)
            for group in plan.groups:
                group_out = _attend_group(q_rows, k_cache, v_cache, plan, group, scale)
                if group.real_queries is not None:
                    group_out = group_out.index_select(0, group.real_queries)
                out_rows.index_copy_(0, group.output_rows, group_out.to(out.dtype))
        return out


def _attend_group(q_rows, k_cache, v_cache, plan: StepPlan, group: PaddedGroup, scale: float) -> torch.Tensor:
    """One padded group. q_rows: q viewed [num_tokens * kv_heads, group * head_dim].

    Returns [size * kv_heads * query_len, group * head_dim] float32, ordered like group.query_rows.
    """
    head_dim = k_cache.shape[-1]
    kv_heads, size = plan.kv_heads, group.size
    queries = q_rows.index_select(0, group.query_rows).float()
    queries = queries.view(size, kv_heads, group.query_len * plan.group, head_dim)
    keys, values = _as_float32(plan.gather(k_cache, v_cache, group.cache_rows))
    keys = keys.view(size, kv_heads, group.context_len, head_dim)
    values = values.view(size, kv_heads, group.context_len, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=scale)
    return out.reshape(size * kv_heads * group.query_len, plan.group * head_dim)


def _attend_long_prefill(q, k, v, k_cache, v_cache, plan: StepPlan, seq: LongPrefill, scale: float) -> torch.Tensor:
    """One long prefill. q: [query_len, heads, head_dim]; k, v: its new tokens' [query_len, kv, head_dim].

    Queries are [kv_heads, group, query_len, head_dim] (a view of q), K/V broadcast over the group by
    a stride-0 expand, so that plain causal attention (which skips the masked half) applies.
    """
    query_len, heads, head_dim = q.shape
    kv_heads, group = plan.kv_heads, plan.group
    if seq.cache_rows is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [kv, context, head_dim], strided views
    else:
        keys, values = plan.gather(k_cache, v_cache, seq.cache_rows)
        keys = keys.view(kv_heads, seq.context_len, head_dim)
        values = values.view(kv_heads, seq.context_len, head_dim)
    keys, values = _as_float32((keys, values))
    queries = q.float().view(query_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    keys = keys[:, None].expand(kv_heads, group, seq.context_len, head_dim)
    values = values[:, None].expand(kv_heads, group, seq.context_len, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seq.mask, is_causal=seq.mask is None,
                                         scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query_len, heads, head_dim).to(q.dtype)


def _as_float32(tensors: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V in float32, the precision attention runs in; no copy when they already are."""
    return tensors[0].float(), tensors[1].float()


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store each token's k/v at its slot (block_id * block_size + offset); slot -1 is skipped.

    k, v: [num_tokens, kv_heads, head_dim] (rows past len(slot_mapping) are ignored);
    caches: [num_blocks, block_size, kv_heads, head_dim]; slot_mapping: [num_slots] int64.
    """
    num_tokens = slot_mapping.shape[0]
    slots = slot_mapping.long()
    k, v = k[:num_tokens], v[:num_tokens]
    if not bool((slots >= 0).all()):  # padding rows: write only the real ones
        valid = (slots >= 0).nonzero().squeeze(1)
        slots, k, v = slots.index_select(0, valid), k.index_select(0, valid), v.index_select(0, valid)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
