"""A minimal generation driver over the real model and a paged KV cache, for tests.

It plays the model runner's part in the smallest way: one sequence (or several) gets blocks from a
trivial allocator, prefill runs the whole prompt (optionally in chunks), decode feeds one token at a
time, and `AttentionMetadata` is built exactly as the backend contract documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.models.llama import LlamaForCausalLM


@dataclass
class PagedSequence:
    """One sequence's tokens and the cache blocks that hold them."""

    token_ids: list[int]
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are already in the cache


class PagedKVCache:
    """Per-layer (k_cache, v_cache) pairs and a free list of block ids.

    Blocks are handed out in a scrambled order so that tests exercise real block-table indirection.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        param = next(model.parameters())
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.block_size = block_size
        self.caches = [
            (torch.zeros(shape, dtype=param.dtype, device=param.device),
             torch.zeros(shape, dtype=param.dtype, device=param.device))
            for _ in range(model.config.num_hidden_layers)
        ]
        order = list(range(num_blocks))
        self.free = order[1::2] + order[0::2]  # not contiguous on purpose

    def ensure_capacity(self, seq: PagedSequence, num_tokens: int) -> None:
        while len(seq.blocks) * self.block_size < num_tokens:
            if not self.free:
                raise RuntimeError("test KV cache is out of blocks")
            seq.blocks.append(self.free.pop(0))

    def slot(self, seq: PagedSequence, position: int) -> int:
        return seq.blocks[position // self.block_size] * self.block_size + position % self.block_size


def build_metadata(
    cache: PagedKVCache, chunks: list[tuple[PagedSequence, int]], device: torch.device
) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
    """Positions, metadata and last-token row of each sequence, for one step.

    `chunks` lists (sequence, number of new tokens); sequences with more than one new token must come
    first (they run the prefill path), single-token decodes after them.
    """
    positions, slots, query_lens, seq_lens, last_rows = [], [], [], [], []
    num_prefills = num_prefill_tokens = 0
    seen_decode = False
    for seq, new in chunks:
        is_decode = new == 1 and seq.num_cached > 0
        if is_decode:
            seen_decode = True
        else:
            assert not seen_decode, "prefill sequences must come before decodes"
            num_prefills += 1
            num_prefill_tokens += new
        start = seq.num_cached
        cache.ensure_capacity(seq, start + new)
        positions.extend(range(start, start + new))
        slots.extend(cache.slot(seq, p) for p in range(start, start + new))
        query_lens.append(new)
        seq_lens.append(start + new)
        last_rows.append(len(positions) - 1)
    max_blocks = max(len(seq.blocks) for seq, _ in chunks)
    tables = [seq.blocks + [0] * (max_blocks - len(seq.blocks)) for seq, _ in chunks]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    metadata = AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decodes=len(chunks) - num_prefills,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
    )
    return torch.tensor(positions, dtype=torch.int64, device=device), metadata, last_rows


@torch.inference_mode()
def run_step(model: LlamaForCausalLM, cache: PagedKVCache, chunks: list[tuple[PagedSequence, int]]) -> torch.Tensor:
    """Run one step; returns the float32 logits of each sequence's last new token, [len(chunks), vocab]."""
    device = next(model.parameters()).device
    positions, metadata, last_rows = build_metadata(cache, chunks, device)
    ids = [seq.token_ids[seq.num_cached + j] for seq, new in chunks for j in range(new)]
    hidden = model(torch.tensor(ids, dtype=torch.int64, device=device), positions, cache.caches, metadata)
    for seq, new in chunks:
        seq.num_cached += new
    return model.compute_logits(hidden[last_rows])


def greedy_generate(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    block_size: int = 4,
    prefill_chunk: int | None = None,
    suppress_ids: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """Greedy continuation of each prompt, all sequences batched in every step.

    Prefill runs in chunks of `prefill_chunk` tokens (None: whole prompt), then every sequence decodes
    together. `suppress_ids` are masked to -inf (as transformers' min_new_tokens masks EOS).
    """
    longest = max(len(p) for p in prompts) + max_new_tokens
    blocks_needed = len(prompts) * (-(-longest // block_size))
    cache = PagedKVCache(model, blocks_needed + 1, block_size)
    seqs = [PagedSequence(list(p)) for p in prompts]
    pending = list(seqs)
    while pending:  # chunked prefill of every prompt, all prompts batched in each step
        chunks = []
        for seq in pending:
            left = len(seq.token_ids) - seq.num_cached
            chunks.append((seq, min(left, prefill_chunk or left)))
        chunks.sort(key=lambda chunk: chunk[1] == 1 and chunk[0].num_cached > 0)  # prefills before decodes
        logits = run_step(model, cache, chunks)
        for (seq, _), row in zip(chunks, logits, strict=True):
            if seq.num_cached == len(seq.token_ids):
                seq.token_ids.append(_pick(row, suppress_ids))
        pending = [s for s in seqs if s.num_cached < len(s.token_ids) - 1]
    while min(len(s.token_ids) - len(p) for s, p in zip(seqs, prompts, strict=True)) < max_new_tokens:
        logits = run_step(model, cache, [(s, 1) for s in seqs])
        for seq, row in zip(seqs, logits, strict=True):
            seq.token_ids.append(_pick(row, suppress_ids))
    return [s.token_ids[len(p):len(p) + max_new_tokens] for s, p in zip(seqs, prompts, strict=True)]


def _pick(logits: torch.Tensor, suppress_ids: frozenset[int]) -> int:
    if suppress_ids:
        logits = logits.clone()
        logits[list(suppress_ids)] = float("-inf")
    return int(torch.argmax(logits))
