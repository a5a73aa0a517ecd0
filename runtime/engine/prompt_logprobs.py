"""Prompt logprobs: how likely each prompt token was, given the tokens before it (vLLM's semantics).

A request asks for them with `SamplingParams.prompt_logprobs = k` (the server sets it for
`/v1/completions` with `echo` and `logprobs`, and for vLLM's `prompt_logprobs`). The result has one
entry per prompt token: None for the first (nothing precedes it), then the token's log-softmax
under the model's raw logits, its rank in the vocabulary and the top k alternatives.

How the engine collects them:
  - Only completion 0 of a request's n collects them; its siblings are unaffected.
  - The LM head runs over every prompt position of that sequence, one prefill chunk at a time:
    the hidden state at position p scores prompt token p + 1. The persistent batch notes which
    flat rows of a step belong to such a sequence (`StepPromptLogprobs.build`); steps without one
    build nothing and run the LM head over their sampled rows only, as before.
  - Logits are computed and log-softmaxed at most `rows_per_slice(vocab)` rows at a time, and
    only the chosen token's logprob, its rank and the top k leave the device, so a long prompt
    never holds prompt_len x vocab floats.
  - Prefix cache: a collecting sequence takes no prefix-cache hits (the scheduler skips the
    lookup), as in vLLM: positions served from the cache have no fresh hidden states to score. Its
    full blocks are still cached for later prompts, and its siblings still hit them. A preempted
    sequence recomputes and rescores from the start; the output processor keeps the first score
    of each position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sits.runtime.engine.request import TokenLogprob
from sits.runtime.engine.scheduler_output import ScheduledSequence
from sits.runtime.engine.sequence import Sequence as EngineSequence

SLICE_ELEMENTS = 1 << 24  # logits scored at once: 64 MiB of float32 (128 rows of a 128k vocabulary)

# request_id -> (position of the first prompt token scored, the logprobs of that token and the next ones)
PromptLogprobChunks = dict[str, tuple[int, list[TokenLogprob]]]


def collects_prompt_logprobs(seq: EngineSequence) -> bool:
    """Whether this sequence scores its prompt (completion 0 of a request that asks)."""
    return seq.params.prompt_logprobs is not None and seq.index == 0


class PromptScoring(Protocol):
    """What `StepPromptLogprobs.build` reads of a sequence's persistent-batch row (`InputBatch`)."""

    scoring_prompt: bool  # prompt tokens are still to be scored (cleared once the last one ran)


def rows_per_slice(vocab_size: int) -> int:
    return max(1, SLICE_ELEMENTS // max(1, vocab_size))


@dataclass(frozen=True)
class _Chunk:
    """A run of scored prompt tokens in one step: prompt tokens first_position.. (count of them)."""

    request_id: str
    first_position: int
    count: int
    k: int


class StepPromptLogprobs:
    """Which flat rows of one step's hidden states score which prompt tokens.

    Args:
        chunks: the scored runs, in row order.
        rows: [M] int64, flat rows of the step's hidden states (a row at position p scores token p + 1).
        targets: [M] int64, the prompt token each row scores.
    """

    def __init__(self, chunks: list[_Chunk], rows: torch.Tensor, targets: torch.Tensor) -> None:
        self.chunks = chunks
        self.rows = rows
        self.targets = targets

    @classmethod
    def build(cls, ordered: Sequence[ScheduledSequence], rows: Sequence[PromptScoring],
              device: torch.device) -> StepPromptLogprobs | None:
        """The step's scored rows, or None when no prompt token of a collecting sequence runs.

        Args:
            ordered: the step's sequences in flat-batch order (their token_ids lay out the rows).
            rows: the persistent-batch row of each of `ordered`; a row whose `scoring_prompt` is
                set still scores its prompt, and is cleared once its chunk reaches the prompt's
                last token (its later steps score nothing).
            device: where rows and targets go.
        """
        chunks: list[_Chunk] = []
        flat_rows: list[int] = []
        targets: list[int] = []
        flat = 0
        for item, row in zip(ordered, rows, strict=True):
            seq = item.sequence
            if row.scoring_prompt:
                start = item.start_position
                end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)  # last row scored
                if end > start:
                    chunks.append(_Chunk(seq.request_id, start + 1, end - start, seq.params.prompt_logprobs or 0))
                    flat_rows.extend(range(flat, flat + end - start))
                    targets.extend(seq.prompt_token_ids[start + 1 : end + 1])
                if end >= seq.num_prompt_tokens - 1:
                    row.scoring_prompt = False
            flat += item.num_new_tokens
        if not chunks:
            return None
        pin = device.type == "cuda"
        host = torch.tensor([flat_rows, targets], dtype=torch.int64, pin_memory=pin)
        on_device = host.to(device, non_blocking=True)
        return cls(chunks, on_device[0], on_device[1])

    @torch.inference_mode()
    def compute(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                vocab_size: int) -> PromptLogprobsOutput:
        """Score the rows of hidden [T, H] (the step's hidden states): the chosen token's logprob,
        its rank and the top k per row, left on the device (nothing here waits for it)."""
        max_k = max(chunk.k for chunk in self.chunks)
        step = rows_per_slice(vocab_size)
        chosen_parts, rank_parts, top_value_parts, top_id_parts = [], [], [], []
        for begin in range(0, int(self.rows.shape[0]), step):
            rows, targets = self.rows[begin : begin + step], self.targets[begin : begin + step]
            logprobs = torch.log_softmax(compute_logits(hidden.index_select(0, rows)).float(), dim=-1)
            chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
            chosen_parts.append(chosen)
            rank_parts.append((logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1)
            if max_k:
                values, ids = logprobs.topk(max_k, dim=-1)
                top_value_parts.append(values)
                top_id_parts.append(ids)
            del logprobs  # the next slice reuses its memory
        cat = torch.cat
        return PromptLogprobsOutput(self.chunks, self.targets, cat(chosen_parts), cat(rank_parts),
                                    cat(top_id_parts) if max_k else None, cat(top_value_parts) if max_k else None)


@dataclass(eq=False)
class PromptLogprobsOutput:
    """One step's prompt scores, on the device until copied (`tensors` / `with_tensors`, as
    `SamplerOutput` does) and read on the host (`to_chunks`).

    Attributes:
        targets: [M] int64 scored token ids; chosen: [M] float32 their logprobs; ranks: [M] int64
        (1 = the most likely token); top_ids, top_logprobs: [M, max k], best first, or None (k = 0).
    """

    chunks: list[_Chunk]
    targets: torch.Tensor
    chosen: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.targets, self.chosen, self.ranks, self.top_ids, self.top_logprobs) if t is not None]

    def with_tensors(self, tensors: list[torch.Tensor]) -> PromptLogprobsOutput:
        parts = iter(tensors)
        targets, chosen, ranks = next(parts), next(parts), next(parts)
        top_ids = next(parts) if self.top_ids is not None else None
        top_logprobs = next(parts) if self.top_logprobs is not None else None
        return PromptLogprobsOutput(self.chunks, targets, chosen, ranks, top_ids, top_logprobs)

    def to_chunks(self) -> PromptLogprobChunks:
        """Per request, the position of its first scored token and the scores (reads the tensors)."""
        targets, chosen, ranks = self.targets.tolist(), self.chosen.tolist(), self.ranks.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_values = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        result: PromptLogprobChunks = {}
        row = 0
        for chunk in self.chunks:
            entries = []
            for i in range(row, row + chunk.count):
                top = list(zip(top_ids[i][: chunk.k], top_values[i][: chunk.k], strict=True)) if chunk.k else []
                entries.append(TokenLogprob(token_id=targets[i], logprob=chosen[i], top=top, rank=ranks[i]))
            row += chunk.count
            result[chunk.request_id] = (chunk.first_position, entries)
        return result
