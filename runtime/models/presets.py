"""Named model shapes for random-weight runs (benchmarks, tests): `--config llama-3-8b` and friends.

Shapes only; pair them with `sits.runtime.models.loading.build_random_model`.
"""

from __future__ import annotations

import copy
import dataclasses

from sits.runtime.models.config import LlamaConfig

_LLAMA3_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=128000,
    eos_token_ids=[128001, 128009], architecture="llama",
)

PRESETS: dict[str, LlamaConfig] = {
    "llama-3-8b": _LLAMA3_8B,
    "llama-3.1-8b": dataclasses.replace(
        _LLAMA3_8B, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "llama-2-7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-5,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=[2], architecture="llama",
    ),
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=[2], architecture="llama",
    ),
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        eos_token_ids=[2], architecture="llama",
    ),
}


def preset_config(name: str) -> LlamaConfig:
    """A copy of the named shape.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model config {name!r}; known: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
