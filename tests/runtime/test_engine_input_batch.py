"""The model runner's persistent batch (`InputBatch`) against a per-token hand computation.

Block tables live in rows kept across steps and updated incrementally; every step's flat batch must
still be exactly what laying the step out from scratch gives: prefills first, positions, cache slots,
cu_seqlens, sequence lengths, block tables padded with 0, sampled rows. Rows are reused, grow, and
follow a sequence that comes back with a new table; a pending token (async scheduling) is taken from
the previous step's sampled ids.
"""

from __future__ import annotations

import pytest
import torch

from sits.runtime.engine.input_batch import InputBatch
from sits.runtime.engine.model_input import build_model_input
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.scheduler_output import ScheduledSequence
from sits.runtime.engine.sequence import PENDING_TOKEN_ID, Sequence

BLOCK = 4


def sequence(seq_id: str, length: int) -> Sequence:
    return Sequence(seq_id, seq_id, 0, list(range(100, 100 + length)), SamplingParams(), 64, 0.0)


def expected_layout(scheduled: list[ScheduledSequence]) -> dict[str, list]:
    """The step laid out token by token, as AttentionMetadata documents it."""
    decode = [s for s in scheduled if len(s.token_ids) == 1 and s.start_position > 0]
    ordered = [s for s in scheduled if s not in decode] + decode
    width = max(len(s.block_ids) for s in ordered)
    layout = {"input_ids": [], "positions": [], "slots": [], "qsl": [0], "seq_lens": [], "tables": [], "logits": [],
              "sampled": []}
    for item in ordered:
        for offset, token in enumerate(item.token_ids):
            position = item.start_position + offset
            layout["input_ids"].append(token)
            layout["positions"].append(position)
            layout["slots"].append(item.block_ids[position // BLOCK] * BLOCK + position % BLOCK)
        layout["qsl"].append(layout["qsl"][-1] + len(item.token_ids))
        layout["seq_lens"].append(item.start_position + len(item.token_ids))
        layout["tables"].append(item.block_ids + [0] * (width - len(item.block_ids)))
        if item.samples:
            layout["logits"].append(layout["qsl"][-1] - 1)
            layout["sampled"].append(item.seq_id)
    layout["num_prefills"] = len(ordered) - len(decode)
    return layout


def actual_layout(model_input) -> dict[str, list]:
    m = model_input.metadata
    assert m.seq_lens_list == m.seq_lens.tolist() and m.max_seq_len == max(m.seq_lens_list)
    starts = m.query_start_loc.tolist()
    assert m.query_lens_list == [b - a for a, b in zip(starts, starts[1:], strict=False)]
    for tensor in (model_input.input_ids, model_input.positions, m.slot_mapping, model_input.logits_indices):
        assert tensor.dtype == torch.int64
    for tensor in (m.query_start_loc, m.seq_lens, m.block_tables):
        assert tensor.dtype == torch.int32
    return {"input_ids": model_input.input_ids.tolist(), "positions": model_input.positions.tolist(),
            "slots": m.slot_mapping.tolist(), "qsl": m.query_start_loc.tolist(), "seq_lens": m.seq_lens.tolist(),
            "tables": m.block_tables.tolist(), "logits": model_input.logits_indices.tolist(),
            "num_prefills": m.num_prefills, "sampled": [seq.seq_id for seq in model_input.sample_sequences]}


class Workload:
    """Sequences that prefill in chunks, then decode, gaining a block every BLOCK tokens."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.next_block = 1
        self.done: dict[str, int] = {}

    def scheduled(self, seq: Sequence, count: int) -> ScheduledSequence:
        table = self.tables.setdefault(seq.seq_id, [])
        start = self.done.get(seq.seq_id, 0)
        while len(table) * BLOCK < start + count:
            table.append(self.next_block)  # the same list object, grown in place (as the KV manager does)
            self.next_block += 3
        self.done[seq.seq_id] = start + count
        tokens = list(range(start, start + count))
        return ScheduledSequence(seq, tokens, start, table, samples=start + count >= seq.num_prompt_tokens)


@pytest.mark.parametrize("pack", [False, True], ids=["cpu-arrays", "packed-as-on-gpu"])
def test_persistent_rows_give_the_same_batch_as_a_fresh_layout_every_step(pack):
    batch = InputBatch(BLOCK, "cpu", rows=2, width=2, pack=pack)  # both grow during the test
    workload = Workload()
    seqs = [sequence(f"s{i}", 5 + 7 * i) for i in range(5)]
    for step in range(14):
        items = []
        for index, seq in enumerate(seqs[: 2 + step // 2]):
            done = workload.done.get(seq.seq_id, 0)
            items.append(workload.scheduled(seq, min(6, seq.num_prompt_tokens - done) if done < seq.num_prompt_tokens
                                            else 1))
            if step == 9 and index == 1:
                items[-1].block_ids = list(items[-1].block_ids)  # a copy: the row is rewritten, not appended to
        built = batch.prepare(items)
        assert actual_layout(built) == expected_layout(items), f"step {step}"
        m = built.metadata
        parts = (built.input_ids, built.positions, m.slot_mapping, built.logits_indices, m.query_start_loc,
                 m.seq_lens, m.block_tables)
        if pack:  # one buffer, every part on a 16-byte boundary (Triton specializes on alignment)
            assert all(t.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr() for t in parts)
            assert all(t.data_ptr() % 16 == 0 for t in parts)
        assert actual_layout(build_model_input(items, BLOCK, "cpu")) == expected_layout(items)
    assert batch.num_rows_in_use == 5


def test_released_rows_are_reused_and_a_returning_sequence_gets_its_new_table():
    batch = InputBatch(BLOCK, "cpu", rows=2, width=4)
    a, b, c = sequence("a", 9), sequence("b", 3), sequence("c", 2)
    first = [ScheduledSequence(a, list(range(9)), 0, [7, 8, 9], True), ScheduledSequence(b, [1, 2, 3], 0, [5], True)]
    batch.prepare(first)
    batch.release([a])  # finished or preempted
    again = [ScheduledSequence(b, [4], 3, first[1].block_ids, True), ScheduledSequence(c, [1, 2], 0, [11], True)]
    assert actual_layout(batch.prepare(again)) == expected_layout(again)
    assert batch.num_rows_in_use == 2
    # "b" comes back after a preemption with a shorter, new table: no block of the old one survives.
    back = [ScheduledSequence(b, [1, 2, 3], 0, [2], True), ScheduledSequence(a, list(range(9)), 0, [3, 4, 6], True)]
    assert actual_layout(batch.prepare(back)) == expected_layout(back)


@pytest.mark.parametrize("pack", [False, True], ids=["cpu-arrays", "packed-as-on-gpu"])
def test_a_pending_token_is_taken_from_the_previous_steps_sampled_ids(pack):
    batch = InputBatch(BLOCK, "cpu", pack=pack)
    a, b = sequence("a", 3), sequence("b", 2)
    batch.prepare([ScheduledSequence(a, [1, 2, 3], 0, [4], True), ScheduledSequence(b, [5, 6], 0, [8], True)])
    batch.record_sampled(torch.tensor([41, 42]))  # a sampled 41, b sampled 42, still "on the device"
    step = batch.prepare([ScheduledSequence(b, [PENDING_TOKEN_ID], 2, [8], True),
                          ScheduledSequence(a, [PENDING_TOKEN_ID], 3, [4, 9], True)])
    assert step.input_ids.tolist() == [42, 41] and step.positions.tolist() == [2, 3]
    assert step.metadata.slot_mapping.tolist() == [8 * BLOCK + 2, 4 * BLOCK + 3]
    # The step after that did not record its samples: a pending token now has no source.
    with pytest.raises(RuntimeError, match="pending token"):
        batch.prepare([ScheduledSequence(a, [PENDING_TOKEN_ID], 4, [4, 9], True)])
