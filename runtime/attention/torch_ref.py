"""The reference attention back end: plain PyTorch, any device, any dtype.

It is the CPU back end and the ground truth the Triton kernels are tested against, so it rounds
where they round and nowhere else (`attention_like_kernels`): scores, softmax, its sum and the
products with V in float32, the probabilities rounded to the model's dtype before they multiply V
(the kernels' tensor-core dot takes them in q's dtype, as FlashAttention does), the output rounded
once. In float32 that rounding is nothing and `scaled_dot_product_attention` computes it without
materialising a score matrix. K/V are read through the block tables exactly as a paged kernel reads
them. What every layer of a step shares (rows to gather, masks, the grouping of sequences, the
gather buffers) is worked out once per step: see `torch_plan.py`, which also gives the layouts.

Per layer: decodes and short prefills go in a few padded groups of similar context length, one
call each, whatever the batch size; a long prefill gets a call of its own, causal (its new k and v
are its context) or masked after a cached prefix (its context is read from the cache).

An fp8 (e4m3) cache is written as clamp(value / scale, ±448) per KV head and read back as
stored * scale in float32 (CPU torch has no fp8 index ops: the cache is gathered and scattered as
bytes). A causal long prefill that attends its own new k and v rounds them through fp8 the same
way, so it sees what a later step reads from the cache (as the Triton kernels, which read it); so too
float32 k and v (--activation-dtype float32) beside a half-precision cache, rounded to its dtype. With
float32 queries attention runs in float32 over the cache's values, its output unrounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sits.runtime.attention.backend import AttentionBackend, AttentionMetadata
from sits.runtime.attention.registry import register_backend
from sits.runtime.attention.torch_plan import LongPrefill, PaddedGroup, StepPlan, step_plan
from sits.runtime.models.rotary import apply_rotary

# Float32 scores one half-precision attention call may hold (64 MB): longer work goes in chunks.
SCORE_ELEMENTS = 1 << 24
FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
KVScales = tuple[torch.Tensor, torch.Tensor] | None  # an fp8 cache's (k_scale, v_scale), [kv_heads] float32


@register_backend
class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch (CPU and CUDA, float32 / float16 / bfloat16, any head size)."""

    name = "torch"
    version = "3"
    priority = 0
    fp8_kv_cache = True

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        return None

    def rope_and_cache_write(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                             k_scale=None, v_scale=None):
        """See AttentionBackend.rope_and_cache_write; returns new rotated tensors (inputs untouched)."""
        q = apply_rotary(q, positions, cos_sin_cache)
        k = apply_rotary(k, positions, cos_sin_cache)
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q, k

    def forward(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                k_scale=None, v_scale=None) -> torch.Tensor:
        """See AttentionBackend.forward. Rows past metadata.num_tokens (padding) are left zero."""
        num_rows, heads, head_dim = q.shape  # num_rows >= metadata.num_tokens (a batch may be padded)
        scales: KVScales = (k_scale, v_scale) if k_scale is not None else None
        plan = step_plan(metadata, k_cache, heads // k_cache.shape[2])
        out = q.new_empty(q.shape)
        out[metadata.num_tokens:] = 0
        for prefill in plan.long_prefills:
            rows = slice(prefill.first_row, prefill.first_row + prefill.query_len)
            out[rows] = _attend_long_prefill(q[rows], k[rows], v[rows], k_cache, v_cache, plan, prefill, scale,
                                             scales)
        if plan.groups:
            # Both viewed [num_rows * kv_heads, group * head_dim]: a row is one KV head's query heads.
            q_rows = q.reshape(num_rows * plan.kv_heads, plan.group * head_dim)
            out_rows = out.view(num_rows * plan.kv_heads, plan.group * head_dim)
            for group in plan.groups:
                group_out = _attend_group(q_rows, k_cache, v_cache, plan, group, scale, scales)
                if group.real_queries is not None:
                    group_out = group_out.index_select(0, group.real_queries)
                out_rows.index_copy_(0, group.output_rows, group_out.to(out.dtype))
        return out


def _attend_group(q_rows, k_cache, v_cache, plan: StepPlan, group: PaddedGroup, scale: float,
                  scales: KVScales = None) -> torch.Tensor:
    """One padded group. q_rows: q viewed [num_tokens * kv_heads, group * head_dim].

    Returns [size * kv_heads * query_len, group * head_dim] float32, ordered like group.query_rows.
    """
    head_dim = k_cache.shape[-1]
    kv_heads, size = plan.kv_heads, group.size
    queries = q_rows.index_select(0, group.query_rows).float()
    queries = queries.view(size, kv_heads, group.query_len * plan.group, head_dim)
    keys, values = _gather_float32(plan, k_cache, v_cache, group.cache_rows,
                                   (size, kv_heads, group.context_len, head_dim), scales)
    if q_rows.dtype == torch.float32:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=scale)
    else:  # sequences in chunks, so that one chunk's scores stay near SCORE_ELEMENTS
        out = queries.new_empty(queries.shape)
        step = max(1, SCORE_ELEMENTS // (kv_heads * queries.shape[2] * group.context_len))
        for first in range(0, size, step):
            seqs = slice(first, first + step)
            mask = None if group.mask is None else group.mask[seqs]
            out[seqs] = attention_like_kernels(queries[seqs], keys[seqs], values[seqs], mask, scale, q_rows.dtype)
    return out.reshape(size * kv_heads * group.query_len, plan.group * head_dim)


def _attend_long_prefill(q, k, v, k_cache, v_cache, plan: StepPlan, seq: LongPrefill, scale: float,
                         scales: KVScales = None) -> torch.Tensor:
    """One long prefill. q: [query_len, heads, head_dim]; k, v: its new tokens' [query_len, kv, head_dim].

    Queries are [kv_heads, group, query_len, head_dim] (a view of q). In float32, K/V broadcast over
    the group by a stride-0 expand, so that plain causal attention (which skips the masked half)
    applies; in half precision see `_long_prefill_like_kernels`.
    """
    query_len, heads, head_dim = q.shape
    kv_heads, group = plan.kv_heads, plan.group
    if seq.cache_rows is None:
        if scales is not None:  # what the cache holds for them
            k, v = fp8_round_trip(k, scales[0]), fp8_round_trip(v, scales[1])
        elif k.dtype != k_cache.dtype:  # float32 activations beside a half-precision cache: what it holds too
            k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)
        keys, values = k.transpose(0, 1).float(), v.transpose(0, 1).float()  # [kv, context, head_dim]
    else:
        keys, values = _gather_float32(plan, k_cache, v_cache, seq.cache_rows,
                                       (kv_heads, seq.context_len, head_dim), scales)
    queries = q.float().view(query_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    if q.dtype != torch.float32:
        out = _long_prefill_like_kernels(queries, keys, values, seq.mask, scale, q.dtype)
    else:
        keys = keys[:, None].expand(kv_heads, group, seq.context_len, head_dim)
        values = values[:, None].expand(kv_heads, group, seq.context_len, head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seq.mask, is_causal=seq.mask is None,
                                             scale=scale)
    return out.permute(2, 0, 1, 3).reshape(query_len, heads, head_dim).to(q.dtype)


def _long_prefill_like_kernels(queries, keys, values, mask, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """A long prefill's attention with the kernels' rounding, in chunks of query rows (bounded scores).

    queries: [kv_heads, group, query_len, head_dim]; keys, values: [kv_heads, context_len, head_dim]
    float32; mask: [query_len, context_len] bool, or None for causal attention (context_len ==
    query_len, no cached prefix). Returns [kv_heads, group, query_len, head_dim] float32.
    """
    kv_heads, group, query_len, head_dim = queries.shape
    context_len = keys.shape[1]
    out = queries.new_empty(queries.shape)
    step = max(1, SCORE_ELEMENTS // (kv_heads * group * context_len))
    for first in range(0, query_len, step):
        rows = slice(first, min(first + step, query_len))
        count = rows.stop - first
        if mask is None:  # query i sits at position context_len - query_len + i and sees keys up to it
            positions = torch.arange(first, rows.stop, device=queries.device) + (context_len - query_len)
            rows_mask = torch.arange(context_len, device=queries.device)[None, :] <= positions[:, None]
        else:
            rows_mask = mask[rows]
        # The group's query heads as extra rows of their KV head: [kv_heads, group * count, head_dim].
        chunk = queries[:, :, rows].reshape(kv_heads, group * count, head_dim)
        result = attention_like_kernels(chunk, keys, values, rows_mask.repeat(group, 1), scale, dtype)
        out[:, :, rows] = result.view(kv_heads, group, count, head_dim)
    return out


def attention_like_kernels(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor | None, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """softmax(queries · keysᵀ · scale) · values, rounded where the Triton attention kernels round.

    queries: [..., Lq, D]; keys, values: [..., Lk, D] (float32 holding `dtype` values); mask: bool,
    broadcastable to [..., Lq, Lk], True where a query may attend a key (every row sees one), or None.
    Returns [..., Lq, D] float32, to be rounded once to `dtype` by the caller.

    As the kernels do: the scores are float32 sums of exact products, softmax runs in float32, the
    probabilities are rounded to `dtype` for the product with V (the kernels' `tl.dot(p.to(q.dtype), v)`)
    while their float32 sum normalizes, and that product accumulates in float32. (The kernels round P
    against the running maximum of the key tiles seen so far, which moves a few outputs by an ulp.)
    Keeping P in float32 instead is hardly closer to a float32 model, but made this back end pick other
    greedy tokens than the kernels at 1.7 % of a random bf16 model's positions (benchmarks/RESULTS.md).
    """
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    scores.sub_(scores.amax(-1, keepdim=True))
    probs = scores.exp_()
    total = probs.sum(-1, keepdim=True)
    return torch.matmul(probs.to(dtype).float(), values).div_(total)


def _gather_float32(plan: StepPlan, k_cache, v_cache, cache_rows: torch.Tensor, shape: tuple[int, ...],
                    scales: KVScales) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V at cache_rows in float32 (the precision attention runs in), viewed as `shape`
    ([..., kv_heads, context_len, head_dim]); an fp8 cache is gathered as bytes and dequantized."""
    if scales is None:
        keys, values = plan.gather(k_cache, v_cache, cache_rows)
        return keys.view(shape).float(), values.view(shape).float()
    keys, values = plan.gather(k_cache.view(torch.uint8), v_cache.view(torch.uint8), cache_rows)
    per_head = (-1, 1, 1)  # [kv_heads] against [..., kv_heads, context_len, head_dim]
    return (keys.view(FP8_DTYPE).view(shape).float() * scales[0].view(per_head),
            values.view(FP8_DTYPE).view(shape).float() * scales[1].view(per_head))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., kv_heads, head_dim] stored in an fp8 cache: clamp(x / scale, ±448) as float8_e4m3fn."""
    return (x.float() / scale.float()[:, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., kv_heads, head_dim] as an fp8 cache gives it back, in float32."""
    return quantize_fp8(x, scale).float() * scale.float()[:, None]


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Store each token's k/v at its slot (block_id * block_size + offset); slot -1 is skipped.

    k, v: [num_tokens, kv_heads, head_dim] (rows past len(slot_mapping) are ignored);
    caches: [num_blocks, block_size, kv_heads, head_dim]; slot_mapping: [num_slots] int64;
    k_scale, v_scale: [kv_heads] float32 for a float8_e4m3fn cache (stored as bytes).
    """
    num_tokens = slot_mapping.shape[0]
    slots = slot_mapping.long()
    k, v = k[:num_tokens], v[:num_tokens]
    if not bool((slots >= 0).all()):  # padding rows: write only the real ones
        valid = (slots >= 0).nonzero().squeeze(1)
        slots, k, v = slots.index_select(0, valid), k.index_select(0, valid), v.index_select(0, valid)
    if k_scale is not None:  # CPU torch cannot index_copy_ fp8: copy the bytes
        k_cache, k = k_cache.view(torch.uint8), quantize_fp8(k, k_scale).view(torch.uint8)
        v_cache, v = v_cache.view(torch.uint8), quantize_fp8(v, v_scale).view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
