"""A `LoadedModel` with seeded random weights and no vocabulary: benchmarks and tests of model shapes.

Random weights need no checkpoint, but the engine still detokenizes what it generates. With no
vocabulary to speak of, `TokenIdTokenizer` spells each token id as text (" 17 4021 ..."), which
costs the engine about what a real incremental detokenizer costs per token.
"""

from __future__ import annotations

import torch

from sits.runtime.attention.backend import AttentionBackend
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.loading import LoadedModel, build_random_model
from sits.runtime.models.token_id_tokenizer import TokenIdTokenizer

__all__ = ["TokenIdTokenizer", "random_loaded_model"]


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
