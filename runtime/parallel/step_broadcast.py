"""One step's batch, sent from the engine's rank to the workers.

The batch travels in two parts: a `StepHeader` of host values (counts and the host lists the
attention back end loops over), sent over the command channel, and one packed int64 tensor of
every index tensor, broadcast over the device group (NCCL on CUDA, so it never leaves the GPUs):

    [input_ids | positions | slot_mapping | query_start_loc | seq_lens | block_tables | logits_indices]
     T           T           T              S+1               S          S*B            L

(T tokens, S sequences, B blocks per table, L sampled rows). One collective per step, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.engine.model_input import ModelInput


@dataclass(frozen=True)
class StepHeader:
    """The host half of a step: sizes to unpack the tensor with, and the metadata's host values."""

    num_tokens: int
    num_seqs: int
    max_blocks: int
    num_logits: int
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    seq_lens_list: list[int]
    query_lens_list: list[int]

    @property
    def sizes(self) -> list[int]:
        """Lengths of the packed tensor's parts, in packing order."""
        t, s = self.num_tokens, self.num_seqs
        return [t, t, t, s + 1, s, s * self.max_blocks, self.num_logits]


def pack_model_input(model_input: ModelInput) -> tuple[StepHeader, torch.Tensor]:
    """(header, packed [sum(header.sizes)] int64 on the batch's device)."""
    m = model_input.metadata
    header = StepHeader(
        num_tokens=model_input.num_tokens,
        num_seqs=m.num_seqs,
        max_blocks=int(m.block_tables.shape[1]),
        num_logits=int(model_input.logits_indices.shape[0]),
        num_prefills=m.num_prefills,
        num_prefill_tokens=m.num_prefill_tokens,
        num_decodes=m.num_decodes,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len,
        seq_lens_list=list(m.seq_lens_list),
        query_lens_list=list(m.query_lens_list),
    )
    parts = [model_input.input_ids, model_input.positions, m.slot_mapping, m.query_start_loc, m.seq_lens,
             m.block_tables.reshape(-1), model_input.logits_indices]
    return header, torch.cat([part.to(torch.int64) for part in parts])


def unpack_model_input(header: StepHeader, packed: torch.Tensor) -> ModelInput:
    """The ModelInput `pack_model_input` packed (no sample_sequences: workers do not sample)."""
    input_ids, positions, slots, query_start_loc, seq_lens, tables, logits_indices = packed.split(header.sizes)
    metadata = AttentionMetadata(
        num_prefills=header.num_prefills,
        num_prefill_tokens=header.num_prefill_tokens,
        num_decodes=header.num_decodes,
        slot_mapping=slots,
        query_start_loc=query_start_loc.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=tables.to(torch.int32).view(header.num_seqs, header.max_blocks),
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        seq_lens_list=list(header.seq_lens_list),
        query_lens_list=list(header.query_lens_list),
    )
    return ModelInput(input_ids=input_ids, positions=positions, metadata=metadata,
                      logits_indices=logits_indices, sample_sequences=[])


def broadcast_packed(packed: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Rank 0's side of the tensor half (the header must already be on its way)."""
    dist.broadcast(packed, src=0, group=group)


def receive_model_input(header: StepHeader, device: torch.device, group: dist.ProcessGroup | None) -> ModelInput:
    """A worker's side: receive the packed tensor the header announced and unpack it."""
    packed = torch.empty(sum(header.sizes), dtype=torch.int64, device=device)
    dist.broadcast(packed, src=0, group=group)
    return unpack_model_input(header, packed)
