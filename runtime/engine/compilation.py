"""`--compile`: torch.compile the model's non-attention parts (RMSNorms and MLPs) where they are called.

Attention stays eager: its back end reads host metadata (torch reference) or launches Triton kernels
with host-side checks, which torch.compile would only break its graphs on. Each module is compiled
in place (`nn.Module.compile`), with dynamic shapes since the token count changes every step.
Decode steps captured in CUDA graphs then replay the compiled kernels.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def compile_non_attention(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder layer's norms and MLP, and the final norm; returns how many modules."""
    targets = []
    for layer in getattr(model.model, "layers", []):
        targets += [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp]
    targets.append(model.model.norm)
    for module in targets:
        module.compile(dynamic=True, backend=backend)
    logger.info("torch.compile (%s): %d norm and MLP modules", backend, len(targets))
    return len(targets)
