"""The torch back end's per-step plan: which cache rows and query rows each attention call reads.

Every layer of a step reads the same block tables, so the rows to gather, the masks and the
grouping of sequences are worked out once per step (on the first layer) and kept on the step's
`AttentionMetadata`; the other layers only gather and attend. The plan also holds the step's
gather buffers: allocating tens of MB afresh in every layer costs more on a CPU (page faults)
than the copy into them.

Sequences are attended in padded groups of similar context length (decodes apart from short
prefills, so one query is never padded to a prompt's length), a few calls per layer whatever the
batch size; a long prefill gets a call of its own (causal attention skips the masked half).

Layouts are head-major, the one `scaled_dot_product_attention` reads fastest, and grouped-query
attention repeats nothing: the `group` query heads that share a KV head become extra query rows
of that head. A group's queries are [size, kv_heads, query_len * group, head_dim] (row i * group + j
is query token i, head j of the KV head's group), gathered from q viewed [num_tokens * kv_heads,
group * head_dim] (row = token * kv_heads + kv_head); its keys and values are
[size, kv_heads, context_len, head_dim], gathered from a cache viewed [num_slots * kv_heads,
head_dim] (row = slot * kv_heads + kv_head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sits.runtime.attention.backend import AttentionMetadata

# Padding worth carrying rather than starting another group (one more gather and attention call
# per layer): about what a group's fixed cost buys in gathered context tokens on a CPU.
GROUP_OVERHEAD_TOKENS = 512
# A sequence joins the current group only while its context is at least this share of the group's
# longest one, which bounds the padding to 1 - GROUP_MIN_FILL of the work. (16 and 64 decodes with
# contexts spread over 100-2000 tokens ran 2.3x faster in 8 and 14 groups than padded in one.)
GROUP_MIN_FILL = 0.9
# Prefills with at least this many new tokens are attended one by one instead of padded into groups.
OWN_CALL_QUERY_LEN = 128
_PLAN_ATTRIBUTE = "_torch_attention_plan"


@dataclass
class PaddedGroup:
    """Sequences attended in one call, padded to the longest query and context among them.

    Attributes:
        size: sequences in the group.
        query_len, context_len: the padded lengths (tokens).
        query_rows: [size * kv_heads * query_len] int64 rows of q (head-major, see the module doc);
            a padded query repeats its sequence's last one.
        cache_rows: [size * kv_heads * context_len] int64 rows of the cache; padded positions read row 0.
        mask: [size, 1, query_len * group, context_len] bool, True where a query may attend a key
            (causal, inside its context); None when nothing is masked (decodes of one length).
        real_queries: [n] int64 positions among the query_rows that are not padding, None if all are.
        output_rows: [n] int64 rows of the output (viewed like q) that the real queries fill.
    """

    size: int
    query_len: int
    context_len: int
    query_rows: torch.Tensor
    cache_rows: torch.Tensor
    mask: torch.Tensor | None
    real_queries: torch.Tensor | None
    output_rows: torch.Tensor


@dataclass
class LongPrefill:
    """A prefill attended on its own: its new tokens are rows first_row .. first_row + query_len - 1.

    cache_rows ([kv_heads * context_len] int64) and mask ([query_len, context_len] bool) are None
    without a cached prefix: the new tokens' own k and v are the whole context, attended causally.
    """

    first_row: int
    query_len: int
    context_len: int
    cache_rows: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class StepPlan:
    """Everything the back end's forward needs from a step's metadata, for one cache geometry."""

    block_size: int
    kv_heads: int
    group: int  # query heads per KV head
    groups: list[PaddedGroup]
    long_prefills: list[LongPrefill]
    gather_rows: int  # rows of the largest single gather (sizes the buffers)
    _buffers: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_rows: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at cache_rows, each [len(cache_rows), head_dim], in the step's reused buffers."""
        head_dim = k_cache.shape[-1]
        if self._buffers is None or self._buffers[0].dtype != k_cache.dtype:
            self._buffers = (k_cache.new_empty(self.gather_rows, head_dim), v_cache.new_empty(self.gather_rows, head_dim))
        count = cache_rows.shape[0]
        keys = torch.index_select(k_cache.view(-1, head_dim), 0, cache_rows, out=self._buffers[0][:count])
        values = torch.index_select(v_cache.view(-1, head_dim), 0, cache_rows, out=self._buffers[1][:count])
        return keys, values


def step_plan(metadata: AttentionMetadata, k_cache: torch.Tensor, group: int) -> StepPlan:
    """The plan for this step and cache geometry, built on the first call and kept on the metadata.

    k_cache: [num_blocks, block_size, kv_heads, head_dim] (one layer's; all layers share the geometry);
    group: query heads per KV head.
    """
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    plan = getattr(metadata, _PLAN_ATTRIBUTE, None)
    if plan is None or (plan.block_size, plan.kv_heads, plan.group) != (block_size, kv_heads, group):
        plan = build_step_plan(metadata, block_size, kv_heads, group)
        setattr(metadata, _PLAN_ATTRIBUTE, plan)
    return plan


def build_step_plan(metadata: AttentionMetadata, block_size: int, kv_heads: int, group: int) -> StepPlan:
    """Sort the step's sequences into long prefills and padded groups, and work out their rows and masks."""
    tables, device = metadata.block_tables, metadata.block_tables.device
    query_lens, context_lens = metadata.query_lens_list, metadata.seq_lens_list[:metadata.num_seqs]
    first_rows = [0]
    for query_len in query_lens[:-1]:
        first_rows.append(first_rows[-1] + query_len)
    long_prefills, short_prefills = [], []
    for seq in range(metadata.num_prefills):
        if query_lens[seq] < OWN_CALL_QUERY_LEN:
            short_prefills.append(seq)
            continue
        query_len, context_len = query_lens[seq], context_lens[seq]
        cache_rows = mask = None
        if context_len > query_len:  # a cached prefix: read the whole context from the cache
            cache_rows = _cache_rows(tables[seq:seq + 1], context_len, block_size, kv_heads)
            mask = _causal_mask([query_len], [context_len], query_len, context_len, device)[0]
        long_prefills.append(LongPrefill(first_rows[seq], query_len, context_len, cache_rows, mask))

    groups = []
    decodes = list(range(metadata.num_prefills, metadata.num_seqs))
    for candidates in (short_prefills, decodes):  # never pad a decode's single query to a prompt's length
        for members in group_by_context([context_lens[seq] for seq in candidates]):
            seqs = [candidates[i] for i in members]
            groups.append(_padded_group(seqs, first_rows, query_lens, context_lens, tables, block_size, kv_heads,
                                        group))
    gather_rows = max([g.cache_rows.shape[0] for g in groups]
                      + [p.cache_rows.shape[0] for p in long_prefills if p.cache_rows is not None], default=0)
    return StepPlan(block_size, kv_heads, group, groups, long_prefills, gather_rows)


def _padded_group(seqs: list[int], first_rows: list[int], query_lens: list[int], context_lens: list[int],
                  tables: torch.Tensor, block_size: int, kv_heads: int, group: int) -> PaddedGroup:
    """The rows and mask of the sequences seqs (indices into the step's batch), padded together."""
    device = tables.device
    group_query_lens = [query_lens[s] for s in seqs]
    group_context_lens = [context_lens[s] for s in seqs]
    query_len, context_len = max(group_query_lens), max(group_context_lens)
    seqs_t = torch.tensor(seqs, dtype=torch.int64, device=device)
    lens_t = torch.tensor(group_query_lens, device=device)
    # Query token rows, [size, query_len]; padding repeats the sequence's last new token.
    offsets = torch.minimum(torch.arange(query_len, device=device)[None, :], lens_t[:, None] - 1)
    token_rows = torch.tensor([first_rows[s] for s in seqs], device=device)[:, None] + offsets
    heads = torch.arange(kv_heads, device=device)[None, :, None]
    query_rows = (token_rows[:, None, :] * kv_heads + heads).reshape(-1)  # [size, kv, query_len]
    real_queries = None
    if min(group_query_lens) < query_len:
        is_real = (torch.arange(query_len, device=device)[None, :] < lens_t[:, None])[:, None, :]
        real_queries = is_real.expand(len(seqs), kv_heads, query_len).reshape(-1).nonzero().squeeze(1)
    cache_rows = _cache_rows(tables.index_select(0, seqs_t), context_len, block_size, kv_heads)
    mask = None
    if query_len > 1 or min(group_context_lens) < context_len:
        allowed = _causal_mask(group_query_lens, group_context_lens, query_len, context_len, device)
        mask = allowed[:, :, None, :].expand(len(seqs), query_len, group, context_len)
        mask = mask.reshape(len(seqs), 1, query_len * group, context_len)
    output_rows = query_rows if real_queries is None else query_rows.index_select(0, real_queries)
    return PaddedGroup(len(seqs), query_len, context_len, query_rows, cache_rows, mask, real_queries, output_rows)


def _causal_mask(query_lens: list[int], context_lens: list[int], query_len: int, context_len: int,
                 device: torch.device) -> torch.Tensor:
    """[seqs, query_len, context_len] bool: new token i of a sequence sits at position
    context - query + i and sees positions up to its own; a padded query sees what the last one sees."""
    queries = torch.tensor(query_lens, device=device)[:, None]
    contexts = torch.tensor(context_lens, device=device)[:, None]
    offsets = torch.minimum(torch.arange(query_len, device=device)[None, :], queries - 1)
    positions = contexts - queries + offsets  # [seqs, query_len]
    return torch.arange(context_len, device=device)[None, None, :] <= positions[:, :, None]


def group_by_context(context_lens: list[int], overhead_tokens: int = GROUP_OVERHEAD_TOKENS,
                     min_fill: float = GROUP_MIN_FILL) -> list[list[int]]:
    """Split sequences into groups padded to their longest context, trading padding for calls.

    Walks the contexts from longest to shortest and starts a new group at a context shorter than
    min_fill of the group's longest, provided that padding every remaining sequence to the group's
    longest would waste more than overhead_tokens. One group keeps batch order; several are in
    descending context order.

    Returns:
        Lists of indices into context_lens, each list one group.
    """
    if not context_lens:
        return []
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    groups: list[list[int]] = [[order[0]]]
    group_max = context_lens[order[0]]
    for rank, index in enumerate(order[1:], start=1):
        context_len, remaining = context_lens[index], len(order) - rank
        if context_len < min_fill * group_max and remaining * (group_max - context_len) > overhead_tokens:
            groups.append([])
            group_max = context_len
        groups[-1].append(index)
    if len(groups) == 1:
        return [list(range(len(context_lens)))]
    return groups


def _cache_rows(tables: torch.Tensor, context_len: int, block_size: int, kv_heads: int) -> torch.Tensor:
    """Head-major cache rows of positions 0 .. context_len-1 of each sequence, [seqs * kv_heads * context_len].

    tables: [seqs, max_blocks] int32 block tables. Positions past a sequence's own context read
    whatever block its table holds there (padding ids are 0, a valid block): the mask hides them.
    """
    device = tables.device
    positions = torch.arange(context_len, device=device)
    blocks = tables[:, : -(-context_len // block_size)].long()
    slots = blocks[:, positions // block_size] * block_size + positions % block_size  # [seqs, context]
    heads = torch.arange(kv_heads, device=device)
    return (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)
