"""The flat batch of one step: token ids, positions, cache slots and attention metadata.

Sequences on the prefill path (several new tokens, or the very first token of a sequence) come
first, single-token decodes after them, as `AttentionMetadata` documents. Everything is built
on the host as Python lists and copied to the device once per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.engine.scheduler_output import ScheduledSequence
from sits.runtime.engine.sequence import Sequence as EngineSequence


@dataclass
class ModelInput:
    """What the model and the sampler consume for one step.

    Attributes:
        input_ids: [num_tokens] int64.
        positions: [num_tokens] int64.
        metadata: the attention layout (slot mapping, block tables, cu_seqlens, lengths).
        logits_indices: [num_samples] int64, the flat row of each sampling sequence's last token.
        sample_sequences: the sequences sampled this step, in logits_indices order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_sequences: list[EngineSequence]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def is_decode(scheduled: ScheduledSequence) -> bool:
    """One new token after a non-empty context: the decode path."""
    return scheduled.num_new_tokens == 1 and scheduled.start_position > 0


def build_model_input(
    scheduled: Sequence[ScheduledSequence], block_size: int, device: torch.device | str
) -> ModelInput:
    """Lay out one step's scheduled sequences as the model's flat batch.

    Args:
        scheduled: the step's sequences in any order (reordered: prefills first, then decodes).
        block_size: tokens per KV block (slot = block_id * block_size + offset).
        device: where the tensors go.
    """
    if not scheduled:
        raise ValueError("cannot build a batch of no sequences")
    prefills = [s for s in scheduled if not is_decode(s)]
    decodes = [s for s in scheduled if is_decode(s)]
    ordered = prefills + decodes

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    sample_sequences: list[EngineSequence] = []
    for item in ordered:
        start, count, table = item.start_position, item.num_new_tokens, item.block_ids
        input_ids.extend(item.token_ids)
        positions.extend(range(start, start + count))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + count))
        query_lens.append(count)
        seq_lens.append(start + count)
        if item.samples:
            logits_rows.append(len(input_ids) - 1)
            sample_sequences.append(item.sequence)

    max_blocks = max(len(item.block_ids) for item in ordered)
    tables = [item.block_ids + [0] * (max_blocks - len(item.block_ids)) for item in ordered]
    query_start_loc = [0]
    for count in query_lens:
        query_start_loc.append(query_start_loc[-1] + count)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = AttentionMetadata(
        num_prefills=len(prefills),
        num_prefill_tokens=sum(query_lens[: len(prefills)]),
        num_decodes=len(decodes),
        slot_mapping=tensor(slots, torch.int64),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
    )
    return ModelInput(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        metadata=metadata,
        logits_indices=tensor(logits_rows, torch.int64),
        sample_sequences=sample_sequences,
    )
