"""The flat batch of one step: token ids, positions, cache slots and attention metadata.

Sequences on the prefill path (several new tokens, or the very first token of a sequence) come
first, single-token decodes after them, as `AttentionMetadata` documents. Everything is built
on the host as Python lists, packed into one host buffer (pinned on CUDA) and sent to the device
with one non-blocking copy; the tensors are views of that one device buffer, so building a step
costs one transfer and never waits for the GPU.
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

    @property
    def is_decode_only(self) -> bool:
        """Every sequence decodes one token (the batches CUDA graphs replay)."""
        return self.metadata.num_prefills == 0


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

    wide = (input_ids, positions, slots, logits_rows)
    narrow = (query_start_loc, seq_lens, [block for row in tables for block in row])
    (ids_t, positions_t, slots_t, logits_t), (qsl_t, seq_lens_t, tables_t) = _to_device(wide, narrow, device)
    metadata = AttentionMetadata(
        num_prefills=len(prefills),
        num_prefill_tokens=sum(query_lens[: len(prefills)]),
        num_decodes=len(decodes),
        slot_mapping=slots_t,
        query_start_loc=qsl_t,
        seq_lens=seq_lens_t,
        block_tables=tables_t.view(len(ordered), max_blocks),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
    )
    return ModelInput(
        input_ids=ids_t,
        positions=positions_t,
        metadata=metadata,
        logits_indices=logits_t,
        sample_sequences=sample_sequences,
    )


def _to_device(
    wide: Sequence[list[int]], narrow: Sequence[list[int]], device: torch.device | str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """int64 tensors of `wide` and int32 tensors of `narrow`, all views of one buffer on `device`.

    Each part starts on a 16-byte boundary (Triton specializes kernels on pointer alignment, so an
    unaligned view would compile a second variant). On CUDA the host buffer is pinned, so the one
    copy is asynchronous.
    """
    device = torch.device(device)
    parts = [(part, torch.int64, 2) for part in wide] + [(part, torch.int32, 4) for part in narrow]
    offsets, total = [], 0  # in 16-byte units
    for values, _, per_unit in parts:
        offsets.append(total)
        total += -(-len(values) // per_unit)
    host = torch.zeros(2 * total, dtype=torch.int64, pin_memory=device.type == "cuda")
    for (values, dtype, _), offset in zip(parts, offsets, strict=True):
        if values:
            host[2 * offset:].view(dtype)[: len(values)] = torch.tensor(values, dtype=dtype)
    on_device = host.to(device, non_blocking=True)
    tensors = [on_device[2 * offset:].view(dtype)[: len(values)]
               for (values, dtype, _), offset in zip(parts, offsets, strict=True)]
    return tensors[: len(wide)], tensors[len(wide):]
