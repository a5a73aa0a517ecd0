"""The reference attention back end: plain PyTorch, any device, any dtype.

It is the CPU back end and the ground truth the Triton kernels are tested against, so it favours
clarity and numerical care over speed: scores and softmax in float32, K/V gathered through the
block tables exactly as a paged kernel reads them. Prefill sequences are handled one at a time
(queries in chunks, so a long prompt never materialises a huge score matrix); all decodes of a
step are handled together, padded to the longest context.
"""

from __future__ import annotations

import torch

from sits.runtime.attention.backend import AttentionBackend, AttentionMetadata
from sits.runtime.attention.registry import register_backend
from sits.runtime.models.rotary import apply_rotary

# Query rows per chunk of a prefill: bounds the float32 score matrix to chunk × context × heads.
_QUERY_CHUNK = 512


@register_backend
class TorchAttentionBackend(AttentionBackend):
    """Paged attention in plain PyTorch (CPU and CUDA, float32 / float16 / bfloat16, any head size)."""

    name = "torch"
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
        out = torch.zeros_like(q)
        block_size = k_cache.shape[1]
        start = 0
        for seq in range(metadata.num_prefills):
            query_len = metadata.query_lens_list[seq]
            seq_len = metadata.seq_lens_list[seq]
            keys, values = gather_context(k_cache, v_cache, metadata.block_tables[seq], seq_len, block_size)
            for chunk_start in range(0, query_len, _QUERY_CHUNK):
                chunk_len = min(_QUERY_CHUNK, query_len - chunk_start)
                rows = slice(start + chunk_start, start + chunk_start + chunk_len)
                first_position = seq_len - query_len + chunk_start
                out[rows] = causal_attention(q[rows], keys, values, scale, first_position)
            start += query_len
        if metadata.num_decodes:
            rows = slice(metadata.num_prefill_tokens, metadata.num_prefill_tokens + metadata.num_decodes)
            out[rows] = self._decode(q[rows], k_cache, v_cache, metadata, scale)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """All single-token decodes at once. q: [num_decodes, heads, head_dim] → same shape."""
        block_size = k_cache.shape[1]
        first = metadata.num_prefills
        seq_lens = metadata.seq_lens_list[first:first + metadata.num_decodes]
        num_blocks = -(-max(seq_lens) // block_size)
        tables = metadata.block_tables[first:first + metadata.num_decodes, :num_blocks].long()
        n, kv_heads, head_dim = q.shape[0], k_cache.shape[2], k_cache.shape[3]
        keys = k_cache[tables].reshape(n, num_blocks * block_size, kv_heads, head_dim)
        values = v_cache[tables].reshape(n, num_blocks * block_size, kv_heads, head_dim)
        group = q.shape[1] // kv_heads
        qf = q.float().view(n, kv_heads, group, head_dim)
        scores = torch.einsum("nkgd,nlkd->nkgl", qf, keys.float()) * scale  # [n, kv, group, ctx]
        lens = torch.tensor(seq_lens, device=q.device)
        past_end = torch.arange(keys.shape[1], device=q.device)[None, :] >= lens[:, None]
        scores.masked_fill_(past_end[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("nkgl,nlkd->nkgd", probs, values.float())
        return out.reshape(n, kv_heads * group, head_dim).to(q.dtype)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store each token's k/v at its slot (block_id * block_size + offset); slot -1 is skipped.

    k, v: [num_tokens, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim].
    """
    num_tokens = slot_mapping.shape[0]
    slots = slot_mapping.long()
    valid = slots >= 0
    slots = slots[valid]
    k_flat = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    v_flat = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    k_flat[slots] = k[:num_tokens][valid].to(k_cache.dtype)
    v_flat[slots] = v[:num_tokens][valid].to(v_cache.dtype)


def gather_context(k_cache, v_cache, block_table, seq_len: int, block_size: int):
    """One sequence's first seq_len keys and values, read through its block table.

    Returns:
        (keys, values), each [seq_len, kv_heads, head_dim] in the cache dtype.
    """
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len]
    values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:seq_len]
    return keys, values


def causal_attention(q, keys, values, scale: float, first_position: int) -> torch.Tensor:
    """Softmax attention of consecutive query positions over a context, causally masked.

    Args:
        q: [num_queries, heads, head_dim]; query j sits at position first_position + j.
        keys, values: [context_len, kv_heads, head_dim], positions 0 .. context_len-1.
        scale: softmax scale.
        first_position: absolute position of q's first row.
    Returns:
        [num_queries, heads, head_dim] in q's dtype; scores and softmax in float32.
    """
    num_queries, heads, head_dim = q.shape
    context_len, kv_heads = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    qf = q.float().view(num_queries, kv_heads, group, head_dim)
    scores = torch.einsum("qkgd,lkd->kgql", qf, keys.float()) * scale  # [kv, group, queries, ctx]
    query_pos = torch.arange(num_queries, device=q.device)[:, None] + first_position
    key_pos = torch.arange(context_len, device=q.device)[None, :]
    scores.masked_fill_(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgql,lkd->qkgd", probs, values.float())
    return out.reshape(num_queries, heads, head_dim).to(q.dtype)
