"""OpenAI's `logit_bias` as one step's sparse (row, token id, bias) triplets.

A request's biases are turned into arrays once, when its sequence gets a row of the persistent
batch (`InputBatch`); a step then gathers only the rows of biased sequences it samples, so a step
whose sequences carry no logit_bias does no work for it at all. The sampler adds the biases to the
logits with one scatter (`apply`), after the min_tokens mask and before the penalties, as vLLM v1's
logit-bias processor does; logprobs are computed earlier, from the raw logits (vLLM's default
`raw_logprobs`), so they do not reflect the bias.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sits.runtime.engine.sequence import Sequence as EngineSequence


class SequenceLogitBias:
    """One sequence's biases as arrays, built once from `SamplingParams.logit_bias`.

    Attributes:
        token_ids: [K] int64 vocabulary ids.
        values: [K] float32 biases (logit units), in token_ids order.
    """

    __slots__ = ("token_ids", "values")

    def __init__(self, logit_bias: dict[int, float]) -> None:
        self.token_ids = np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias))
        self.values = np.fromiter(logit_bias.values(), dtype=np.float32, count=len(logit_bias))

    @classmethod
    def of(cls, sequence: EngineSequence) -> SequenceLogitBias | None:
        """The sequence's biases, or None when its request gave none."""
        bias = sequence.params.logit_bias
        return cls(bias) if bias else None


class StepLogitBias:
    """The biases of one step's sampled rows, on the device.

    Attributes:
        rows: [E] int64, each entry's row in the step's logits (the sampler's row order).
        token_ids: [E] int64 columns.
        values: [E] float32 biases.
    """

    def __init__(self, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor) -> None:
        self.rows = rows
        self.token_ids = token_ids
        self.values = values

    @classmethod
    def build(cls, entries: Sequence[tuple[int, SequenceLogitBias]], device: torch.device) -> StepLogitBias | None:
        """Triplets of the `(logits row, biases)` pairs, sent in two copies (pinned and
        non-blocking on CUDA, so building a step never waits for the device); None for no pairs."""
        if not entries:
            return None
        counts = [len(bias.token_ids) for _, bias in entries]
        index = np.empty((2, sum(counts)), dtype=np.int64)
        index[0] = np.repeat(np.array([row for row, _ in entries], dtype=np.int64), counts)
        index[1] = np.concatenate([bias.token_ids for _, bias in entries])
        values = np.concatenate([bias.values for _, bias in entries])
        index_t, values_t = to_device(index, device), to_device(values, device)
        return cls(index_t[0], index_t[1], values_t)

    @classmethod
    def of_sequences(cls, sequences: Sequence[EngineSequence], device: torch.device | str) -> StepLogitBias | None:
        """The biases of `sequences` (row i for sequences[i]), for one-off callers: this looks at
        every sequence, which the per-step path avoids by keeping biases in the persistent batch."""
        entries = [(row, bias) for row, seq in enumerate(sequences) if (bias := SequenceLogitBias.of(seq))]
        return cls.build(entries, torch.device(device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Add the biases to `logits` ([N, V] float32) in place; -inf (a masked token) stays -inf."""
        return logits.index_put_((self.rows, self.token_ids), self.values, accumulate=True)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on the device; on CUDA through pinned memory, so the copy does not wait for queued work."""
    host = torch.from_numpy(array)
    if device.type == "cpu":
        return host
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
