"""A `LoadedModel` with seeded random weights and no vocabulary: benchmarks and tests of model shapes.

Random weights need no checkpoint, but the engine still detokenizes what it generates. With no
vocabulary to speak of, `TokenIdTokenizer` spells each token id as text (" 17 4021 ..."), which
costs the engine about what a real incremental detokenizer costs per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sits.runtime.attention.backend import AttentionBackend
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.loading import LoadedModel, build_random_model


class TokenIdTokenizer:
    """Text ↔ token ids for models without a vocabulary: ids written as space-separated numbers."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """'17 4021' → [17, 4021]; raises ValueError on anything but ids in the vocabulary."""
        ids = [int(part) for part in text.split()]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range (vocabulary {self.vocab_size}): {bad[:5]}")
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(t)}" for t in token_ids
                       if not (skip_special_tokens and int(t) in self.eos_token_ids))


def random_loaded_model(
    config: LlamaConfig,
    backend: AttentionBackend,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_positions: int | None = None,
    name: str = "random",
) -> LoadedModel:
    """build_random_model wrapped as the LoadedModel the engine takes, with a TokenIdTokenizer."""
    device = torch.device(device)
    model = build_random_model(config, backend, device, dtype, seed, max_positions)
    tokenizer = TokenIdTokenizer(config.vocab_size, config.eos_token_ids)
    return LoadedModel(model, tokenizer, config, name, f"random:{name}:seed={seed}", device, dtype)
