"""Sampler test inputs: a small vocabulary, sequences with given prompts, outputs and params, and
seeded logits."""

from __future__ import annotations

import torch

from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.sequence import Sequence

VOCAB = 12
EOS = 0


def seq(seq_id="s", prompt=(1, 2, 3), output=(), **params) -> Sequence:
    s = Sequence(seq_id, seq_id, 0, list(prompt), SamplingParams(**params), max_tokens=100, arrival_time=0.0)
    for token in output:
        s.append_output_token(token)
    return s


def fixed_logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    """[rows, VOCAB] float32, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * 2
