"""vLLM's `allowed_token_ids` and `bad_words` as one step's token masks.

`allowed_token_ids` keeps only the listed tokens of a row: the others become -inf. `bad_words` bans
words from the output: each word is tokenized as it is and with a leading space (vLLM's rule,
`bad_words_token_ids`); a one-token word is banned outright, and a word of several tokens bans its
last token whenever the output so far ends with its other tokens (vLLM matches the output tokens
only, not the prompt).

Costs, and where they are paid (as for `logit_bias.py`):
  - A sequence's allowed ids and words become arrays once, when it takes a row of the persistent
    batch (`InputBatch`); a step gathers only the rows of such sequences it samples, so a step whose
    sequences use neither option does no work for them at all.
  - The banned tokens of a row depend on its output so far (a word's prefix), so they are found on
    the host each step, from the sequence's output tokens: the engine does not run ahead (async
    scheduling) while a request with bad_words runs, as for penalties and grammars. The allowed
    ids never change, so they need no such wait.
  - A step's masks reach the device in one copy (pinned and non-blocking on CUDA).

The sampler applies the masks after computing logprobs (which stay those of the raw logits, vLLM's
default `raw_logprobs`) and before the min_tokens mask, logit_bias and the penalties, in vLLM's
order; a grammar mask (structured outputs) was already applied by the runner, and a token masked by
either stays masked.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sits.runtime.engine.bad_words import bad_words_token_ids, resolve_bad_words
from sits.runtime.engine.logit_bias import to_device
from sits.runtime.engine.sequence import Sequence as EngineSequence

__all__ = ["SequenceTokenMask", "StepTokenMask", "bad_words_token_ids", "resolve_bad_words"]

_NO_IDS = np.empty(0, dtype=np.int64)


class SequenceTokenMask:
    """One sequence's allowed ids and banned words as arrays, built once from its SamplingParams.

    Attributes:
        sequence: the sequence (its output tokens decide which word endings are banned).
        allowed: [A] int64 vocabulary ids the sequence may sample, or None (all of them).
        banned: [B] int64 ids of one-token bad words (always banned).
        endings: (prefix, last id) of each bad word of several tokens: `last` is banned while the
            output ends with `prefix`.
    """

    __slots__ = ("sequence", "allowed", "banned", "endings")

    def __init__(self, sequence: EngineSequence) -> None:
        params = sequence.params
        self.sequence = sequence
        allowed = params.allowed_token_ids
        self.allowed = np.unique(np.asarray(allowed, dtype=np.int64)) if allowed else None
        words = params.bad_words_token_ids or []
        self.banned = np.unique(np.asarray([w[0] for w in words if len(w) == 1], dtype=np.int64))
        self.endings = [(list(w[:-1]), w[-1]) for w in words if len(w) > 1]

    @classmethod
    def of(cls, sequence: EngineSequence) -> SequenceTokenMask | None:
        """The sequence's masks, or None when its request gave neither option."""
        params = sequence.params
        return cls(sequence) if params.allowed_token_ids or params.bad_words_token_ids else None

    def banned_now(self) -> np.ndarray:
        """[B'] int64 ids banned for the next token, given the output so far."""
        if not self.endings:
            return self.banned
        output = self.sequence.output_token_ids
        ended = [last for prefix, last in self.endings
                 if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix]
        return np.concatenate([self.banned, np.asarray(ended, dtype=np.int64)]) if ended else self.banned


class StepTokenMask:
    """The allowed ids and banned tokens of one step's sampled rows, on the device.

    Attributes:
        allowed_rows: [R] int64 rows (in the step's logits) restricted to their allowed ids.
        kept_rows, kept_ids: [E] int64 (row, id) of every allowed id of those rows.
        banned_rows, banned_ids: [F] int64 (row, id) of every banned token.
    """

    def __init__(self, allowed_rows: torch.Tensor, kept_rows: torch.Tensor, kept_ids: torch.Tensor,
                 banned_rows: torch.Tensor, banned_ids: torch.Tensor) -> None:
        self.allowed_rows = allowed_rows
        self.kept_rows = kept_rows
        self.kept_ids = kept_ids
        self.banned_rows = banned_rows
        self.banned_ids = banned_ids

    @classmethod
    def build(cls, entries: Sequence[tuple[int, SequenceTokenMask]], device: torch.device) -> StepTokenMask | None:
        """The masks of the `(logits row, sequence masks)` pairs in one copy; None when they mask nothing."""
        allowed = [(row, mask.allowed) for row, mask in entries if mask.allowed is not None]
        banned = [(row, ids) for row, mask in entries if len(ids := mask.banned_now())]
        if not allowed and not banned:
            return None
        parts = [np.array([row for row, _ in allowed], dtype=np.int64), *_pairs(allowed), *_pairs(banned)]
        sizes = [len(part) for part in parts]
        flat = to_device(np.concatenate(parts), device)
        return cls(*flat.split(sizes))

    @classmethod
    def of_sequences(cls, sequences: Sequence[EngineSequence], device: torch.device | str) -> StepTokenMask | None:
        """The masks of `sequences` (row i for sequences[i]), for one-off callers (`Sampler.__call__`);
        `bad_words` must be resolved to token ids already (`resolve_bad_words`)."""
        entries = [(row, mask) for row, seq in enumerate(sequences) if (mask := SequenceTokenMask.of(seq))]
        return cls.build(entries, torch.device(device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the disallowed and banned tokens of `logits` ([N, V] float32) to -inf, in place."""
        if len(self.allowed_rows):
            kept = logits[self.kept_rows, self.kept_ids]
            logits.index_fill_(0, self.allowed_rows, float("-inf"))
            logits.index_put_((self.kept_rows, self.kept_ids), kept)
        if len(self.banned_ids):
            logits.index_put_((self.banned_rows, self.banned_ids), logits.new_full((), float("-inf")))
        return logits


def _pairs(entries: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The flat (rows, ids) of `(row, ids)` pairs."""
    if not entries:
        return _NO_IDS, _NO_IDS
    rows = np.repeat(np.array([row for row, _ in entries], dtype=np.int64), [len(ids) for _, ids in entries])
    return rows, np.concatenate([ids for _, ids in entries])
