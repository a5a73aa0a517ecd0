"""The runner's persistent batch: per-sequence block tables kept on the host across steps.

Rebuilding every sequence's block table from Python lists each step costs O(sequences x blocks)
of Python (128 blocks per 2,048-token context): at batch 256 that alone is milliseconds per step,
while the GPU waits. As vLLM v1's `InputBatch` does, each running sequence instead owns a row of
one preallocated int32 array for as long as it holds KV blocks; a step copies into it only the
blocks added since the sequence last ran (one block every block_size decode steps), and a row is
given back when its sequence finishes or is preempted. The row hangs off its sequence
(`Sequence.batch_row`): the batch keeps no map by sequence id. The scheduler still hands over plain lists
(`ScheduledSequence.block_ids`, the KV manager's live table): the row knows the list it mirrors and
how much of it it holds, so it notices new blocks by length and a new table by identity.

Everything else of a step (positions, cache slots, cu_seqlens, sequence lengths, the step's rows of
the block table) is computed with a few vectorized numpy operations over per-sequence values, then
written into one host buffer (pinned on CUDA) and sent with one non-blocking copy: the tensors of
`ModelInput` are views of that one device buffer, so building a step never waits for the GPU.

A sequence whose request gave `logit_bias` keeps its biases with its row (as arrays, built when the
row is taken); a step gathers them for the biased rows it samples only, so steps of sequences
without logit_bias spend nothing on it (`logit_bias.py`). A sequence under a response_format has
its grammar matcher (`Sequence.grammar`) noted with its row the same way, and a step fills the
grammar bitmask of those rows only (`grammar_mask.py`). A sequence whose request gave
allowed_token_ids or bad_words keeps them with its row as arrays too, and a step gathers them for
those rows only (`token_masks.py`). A sequence that scores its prompt (prompt logprobs) is noted
when it takes its row, and a step lists its rows to score only while such a sequence still has
prompt to run (`prompt_logprobs.py`). The rows that carry any of these are kept in one set, so a
step whose rows carry none spends nothing on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.engine.grammar_mask import StepGrammarMask
from sits.runtime.engine.logit_bias import SequenceLogitBias, StepLogitBias
from sits.runtime.engine.model_input import ModelInput
from sits.runtime.engine.prompt_logprobs import StepPromptLogprobs, collects_prompt_logprobs
from sits.runtime.engine.scheduler_output import ScheduledSequence
from sits.runtime.engine.sequence import PENDING_TOKEN_ID
from sits.runtime.engine.sequence import Sequence as EngineSequence
from sits.runtime.engine.spec_verify import SpecRow
from sits.runtime.engine.structured_output import SequenceGrammar
from sits.runtime.engine.token_masks import SequenceTokenMask, StepTokenMask


class _Row:
    """One sequence's row of the block-table array, the list it mirrors, and what its sampling
    needs per step (built when the row is taken)."""

    __slots__ = ("owner", "index", "table", "written", "sampled_step", "sampled_row", "logit_bias", "grammar",
                 "token_mask", "scoring_prompt")

    def __init__(self, owner: InputBatch, index: int, table: list[int], seq: EngineSequence) -> None:
        self.owner = owner  # the batch whose array holds the row
        self.index = index
        self.table = table  # the sequence's block_ids (kept to compare identity)
        self.written = 0  # leading entries of `table` already in the row
        self.sampled_step = -1  # the last step that sampled for this sequence ...
        self.sampled_row = -1  # ... and the sequence's row in that step's sampled ids
        self.logit_bias: SequenceLogitBias | None = SequenceLogitBias.of(seq)  # its logit_bias, or None
        self.grammar: SequenceGrammar | None = seq.grammar  # its matcher under a response_format
        self.token_mask: SequenceTokenMask | None = SequenceTokenMask.of(seq)  # its allowed_token_ids / bad_words
        self.scoring_prompt = collects_prompt_logprobs(seq)  # its prompt logprobs are not all run yet

    @property
    def has_extras(self) -> bool:
        return (self.logit_bias is not None or self.grammar is not None or self.token_mask is not None
                or self.scoring_prompt)


class InputBatch:
    """Builds each step's `ModelInput`, keeping block tables in rows that live across steps.

    It also remembers, per sequence, where its token sits in the latest step's sampled ids, and the
    runner hands it those ids (`record_sampled`, still on the device): a token the scheduler marked
    `PENDING_TOKEN_ID` (async scheduling) is put in place from them on the device, so the next step
    never waits for the previous one's tokens to reach the host.

    Args:
        block_size: tokens per KV block (slot = block_id * block_size + offset).
        device: where the step's tensors go.
        rows, width: initial capacity (sequences x blocks per sequence); both grow on demand.
        pack: send the step as one packed buffer (None: everywhere but on a CPU, where the arrays
            are used as they are); True on a CPU tests the packed layout a GPU gets.
        persistent: rows live across steps on their sequences (`Sequence.batch_row`); False for a
            one-off batch (`build_model_input`), whose rows last one `prepare` and touch no sequence.
    """

    def __init__(self, block_size: int, device: torch.device | str, rows: int = 8, width: int = 16,
                 pack: bool | None = None, persistent: bool = True) -> None:
        self.block_size = block_size
        self._persistent = persistent
        self.device = torch.device(device)
        self._pack = self.device.type != "cpu" if pack is None else pack
        self._pin = self.device.type == "cuda"
        self._tables = np.zeros((rows, width), dtype=np.int32)  # rows past a table's length stay 0
        # The rows in use carrying a logit_bias, grammar, token mask or prompt to score (insertion order).
        self._extra_rows: dict[_Row, None] = {}
        self.lora_enabled = False  # steps carry their sequences' LoRA slots (set by the runner)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))
        self._step = 0  # steps prepared so far
        self._sampled_ids: torch.Tensor | None = None  # [N] int64 on the device, of step _sampled_step
        self._sampled_step = -1

    @property
    def num_rows_in_use(self) -> int:
        return self._tables.shape[0] - len(self._free_rows)

    def release(self, sequences: Iterable[EngineSequence]) -> None:
        """Give back the rows of sequences that finished or lost their blocks (preempted)."""
        for seq in sequences:
            row: _Row | None = seq.batch_row
            if row is not None and row.owner is self:
                seq.batch_row = None
                self._extra_rows.pop(row, None)
                self._tables[row.index, : row.written] = 0
                self._free_rows.append(row.index)

    def record_sampled(self, token_ids: torch.Tensor) -> None:
        """The token ids the step just prepared sampled ([N] int64, sample_sequences order, on the
        device): the source of its sequences' pending tokens in the next step."""
        self._sampled_ids = token_ids
        self._sampled_step = self._step - 1

    def prepare(self, scheduled: Sequence[ScheduledSequence]) -> ModelInput:
        """The step's flat batch: prefill-path sequences first, then single-token decodes.

        Args:
            scheduled: the step's sequences in any order.
        """
        if not scheduled:
            raise ValueError("cannot build a batch of no sequences")
        prefills = [s for s in scheduled if not (len(s.token_ids) == 1 and s.start_position > 0)]
        ordered = [s for s in scheduled if len(s.token_ids) == 1 and s.start_position > 0]
        num_prefills = len(prefills)
        if prefills:
            ordered = prefills + ordered
        step = self._step
        self._step += 1
        rows, starts, counts, input_ids, widths, sample_sequences, sampled_seqs = [], [], [], [], [], [], []
        fill_at, fill_from, spec_rows, row_objects = [], [], [], []
        for index, item in enumerate(ordered):
            row = self._sync_row(item)
            rows.append(row.index)
            row_objects.append(row)
            starts.append(item.start_position)
            token_ids = item.token_ids
            counts.append(len(token_ids))
            input_ids += token_ids
            widths.append(len(item.block_ids))
            if token_ids[-1] == PENDING_TOKEN_ID:
                fill_at.append(len(input_ids) - 1)
                fill_from.append(self._pending_source(item, row))
            if item.draft_token_ids:  # speculative drafts end the chunk: logits at each are verified
                spec_rows.append(SpecRow(len(sampled_seqs), len(input_ids) - len(token_ids), item.draft_token_ids))
            if item.samples:
                row.sampled_step, row.sampled_row = step, len(sampled_seqs)
                sampled_seqs.append(index)
                sample_sequences.append(item.sequence)
        model_input = self._assemble(rows, starts, counts, input_ids, max(widths), sampled_seqs, sample_sequences,
                                     num_prefills, fill_at, fill_from)
        if self._extra_rows:  # only while a row carries a logit_bias, mask, grammar or prompt to score
            self._add_extras(model_input, step, ordered, row_objects)
        if spec_rows:
            model_input.spec_rows = spec_rows
        if self.lora_enabled:
            model_input.lora_slots = [item.sequence.lora_slot for item in ordered]
        return model_input

    def _add_extras(self, model_input: ModelInput, step: int, ordered: list[ScheduledSequence],
                    rows: list[_Row]) -> None:
        """The step's logit biases, token masks and grammar bitmask of the rows it samples, and the
        prompt rows it scores (the matchers are up to date: the engine does not run ahead while
        they run)."""
        sampled = [row for row in self._extra_rows if row.sampled_step == step]
        model_input.logit_bias = StepLogitBias.build(
            [(row.sampled_row, row.logit_bias) for row in sampled if row.logit_bias is not None], self.device)
        model_input.token_mask = StepTokenMask.build(
            [(row.sampled_row, row.token_mask) for row in sampled if row.token_mask is not None], self.device)
        grammars = [(row.sampled_row, row.grammar) for row in sampled if row.grammar is not None]
        if grammars:
            model_input.grammar_mask = StepGrammarMask.build(
                [(r, g) for r, g in grammars if not g.ended], len(model_input.sample_sequences),
                grammars[0][1].vocab_size, self.device)
        if any(row.scoring_prompt for row in self._extra_rows):
            model_input.prompt_logprobs = StepPromptLogprobs.build(ordered, rows, self.device)
            for row in [row for row in self._extra_rows if not row.has_extras]:  # done scoring, nothing else
                del self._extra_rows[row]

    # -- internals -------------------------------------------------------------------------
    def _pending_source(self, item: ScheduledSequence, row: _Row) -> int:
        """Where the previous step's sampled ids hold the pending last token of `item`."""
        if (row.sampled_step != self._sampled_step or self._sampled_step != self._step - 2
                or PENDING_TOKEN_ID in item.token_ids[:-1]):
            raise RuntimeError(f"sequence {item.sequence.seq_id!r} has a pending token the previous step "
                               "did not sample")
        return row.sampled_row

    def _sync_row(self, item: ScheduledSequence) -> _Row:
        """The row of item's sequence, with every block of its table copied in."""
        table = item.block_ids
        seq = item.sequence
        row = seq.batch_row
        if row is None or row.owner is not self:
            if not self._free_rows:
                self._grow(rows=2 * self._tables.shape[0])
            row = _Row(self, self._free_rows.pop(), table, seq)
            if self._persistent:
                seq.batch_row = row
            if row.has_extras:
                self._extra_rows[row] = None
        elif row.table is not table:  # a new table (the sequence was preempted and came back)
            self._tables[row.index, : row.written] = 0
            row.table, row.written = table, 0
        length = len(table)
        if length != row.written:
            if length < row.written:  # only a caller's own list can shrink; rewrite the row
                self._tables[row.index, : row.written] = 0
                row.written = 0
            if length > self._tables.shape[1]:
                self._grow(width=max(length, 2 * self._tables.shape[1]))
            self._tables[row.index, row.written : length] = table[row.written : length]
            row.written = length
        return row

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self._tables.shape
        grown = np.zeros((rows or old_rows, width or old_width), dtype=np.int32)
        grown[:old_rows, :old_width] = self._tables
        self._tables = grown
        self._free_rows.extend(range((rows or old_rows) - 1, old_rows - 1, -1))

    def _assemble(self, rows: list[int], starts: list[int], counts: list[int], input_ids: list[int], width: int,
                  sampled_seqs: list[int], sample_sequences: list, num_prefills: int, fill_at: list[int],
                  fill_from: list[int]) -> ModelInput:
        num_seqs, num_tokens = len(rows), len(input_ids)
        rows_np = np.array(rows, dtype=np.intp)
        starts_np = np.array(starts, dtype=np.int64)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        if num_tokens == num_seqs:  # one token each (decodes): no per-token expansion
            query_start_loc[1:] = np.arange(1, num_seqs + 1)
            positions, token_rows = starts_np, rows_np
            counts_np = None
        else:
            counts_np = np.array(counts, dtype=np.int64)
            np.cumsum(counts_np, out=query_start_loc[1:])
            positions = np.repeat(starts_np - query_start_loc[:-1], counts_np) + np.arange(num_tokens)
            token_rows = np.repeat(rows_np, counts_np)
        seq_lens = starts_np + (1 if counts_np is None else counts_np)
        block_size = self.block_size
        slots = self._tables[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        logits_rows = query_start_loc[1:][sampled_seqs] - 1
        tables = self._tables[rows_np, :width]
        wide = (np.array(input_ids, dtype=np.int64), positions, slots, logits_rows, fill_at, fill_from)
        narrow = (query_start_loc, seq_lens, tables.reshape(-1))
        (ids_t, positions_t, slots_t, logits_t, fill_at_t, fill_from_t), (qsl_t, seq_lens_t, tables_t) = (
            self._to_device(wide, narrow))
        if fill_at:  # the previous step's tokens, straight from its sampled ids on the device
            ids_t.index_copy_(0, fill_at_t, self._sampled_ids.index_select(0, fill_from_t))
        seq_lens_list = seq_lens.tolist()
        metadata = AttentionMetadata(
            num_prefills=num_prefills,
            num_prefill_tokens=int(query_start_loc[num_prefills]),
            num_decodes=num_seqs - num_prefills,
            slot_mapping=slots_t,
            query_start_loc=qsl_t,
            seq_lens=seq_lens_t,
            block_tables=tables_t.view(num_seqs, width),
            max_query_len=max(counts),
            max_seq_len=max(seq_lens_list),
            seq_lens_list=seq_lens_list,
            query_lens_list=counts,
        )
        return ModelInput(input_ids=ids_t, positions=positions_t, metadata=metadata, logits_indices=logits_t,
                          sample_sequences=sample_sequences)

    def _to_device(self, wide: Sequence[np.ndarray | list[int]], narrow: Sequence[np.ndarray]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """int64 tensors of `wide` and int32 tensors of `narrow` on the device.

        On a CPU they are the arrays themselves. Elsewhere they are views of one device buffer,
        filled by one copy of one host buffer, pinned (PyTorch's caching host allocator keeps it
        from being reused before the copy ran) so that the copy is asynchronous; each part starts on
        a 16-byte boundary (Triton specializes kernels on pointer alignment, so an unaligned view
        would compile a second variant).
        """
        if not self._pack:
            return ([torch.from_numpy(np.asarray(part, dtype=np.int64)) for part in wide],
                    [torch.from_numpy(np.ascontiguousarray(part, dtype=np.int32)) for part in narrow])
        wide_sizes = [2 * -(-len(part) // 2) for part in wide]  # int64 elements, rounded to 16 bytes
        narrow_sizes = [4 * -(-len(part) // 4) for part in narrow]  # int32 elements, the same
        wide_total = sum(wide_sizes)
        host = torch.empty(wide_total + sum(narrow_sizes) // 2, dtype=torch.int64, pin_memory=self._pin)
        host64 = host.numpy()
        host32 = host64[wide_total:].view(np.int32)
        offset = 0
        for part, size in zip(wide, wide_sizes, strict=True):
            host64[offset : offset + len(part)] = part
            offset += size
        offset = 0
        for part, size in zip(narrow, narrow_sizes, strict=True):
            host32[offset : offset + len(part)] = part
            offset += size
        on_device = host.to(self.device, non_blocking=True)
        wide_t = on_device[:wide_total].split(wide_sizes)
        narrow_t = on_device[wide_total:].view(torch.int32).split(narrow_sizes)
        return ([t if size == len(part) else t[: len(part)] for t, part, size in zip(wide_t, wide, wide_sizes,
                                                                                      strict=True)],
                [t if size == len(part) else t[: len(part)] for t, part, size in zip(narrow_t, narrow, narrow_sizes,
                                                                                      strict=True)])
