"""One step's grammar bitmask: the tokens each constrained row may sample next (structured outputs).

The persistent batch (`InputBatch`) knows which of a step's sampled rows belong to constrained
sequences; only those rows' matchers fill the bitmask, on the host, and the runner applies it to
the logits before the sampler runs (masked tokens become -inf), as vLLM applies its grammar bitmask.
So greedy, sampling, penalties and logprobs all see the masked logits; unconstrained rows of the
same step are left untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sits.runtime.engine.structured_output import SequenceGrammar


class StepGrammarMask:
    """The bitmask of one step's constrained rows.

    Attributes:
        bitmask: [N, ceil(V / 32)] int32 on the logits' device (bit j of a row set: token j allowed);
            rows of unconstrained sequences are all ones and are not applied.
        rows: the constrained rows (indices into the step's sampled rows), ascending.
        vocab_size: V, the width of the logits.
    """

    def __init__(self, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
        self.bitmask = bitmask
        self.rows = rows
        self.vocab_size = vocab_size

    @classmethod
    def build(cls, entries: Sequence[tuple[int, SequenceGrammar]], num_rows: int, vocab_size: int,
              device: torch.device) -> StepGrammarMask | None:
        """Fill the rows of the `(sampled row, grammar)` pairs; None for no pairs.

        On CUDA the host bitmask is pinned and copied without blocking, so building a step never
        waits for the device.
        """
        if not entries:
            return None
        import xgrammar

        host = xgrammar.allocate_token_bitmask(num_rows, vocab_size)  # all ones: everything allowed
        for row, grammar in entries:
            grammar.fill(host, row)
        if device.type == "cuda":
            bitmask = host.pin_memory().to(device, non_blocking=True)
        else:
            bitmask = host if device.type == "cpu" else host.to(device)
        return cls(bitmask, sorted(row for row, _ in entries), vocab_size)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set disallowed tokens of the constrained rows of `logits` ([N, V] float) to -inf, in place."""
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size, indices=self.rows)
        return logits
