"""Decode steps without norm launches: each decoder norm folded into the projections around it.

A Llama layer normalizes the residual stream twice (input_layernorm before qkv_proj, post_attention_layernorm
before gate_up_proj), and each norm is a launch of its own between two GEMMs. At decode batches, where the
small-M GEMMs run (small_m_linear.py), `fold_decoder_norms` removes those launches:

- the norm weight g moves into the weight of the projection it feeds, once at start-up: W' = W diag(g)
  (rounded to the weight's dtype), and the norm keeps weight 1, so every path (prefill, cuBLAS, the torch
  back end) computes the same model as before, up to that rounding;
- the projection that feeds the stream (o_proj, down_proj) adds its float32 sums to the float32 stream in
  its epilogue, writes the new stream rounded to the model dtype, and each row's sums of squares per 32
  columns (`DecodeLinear.to_stream`, gemm_small_m.add_to_stream);
- the next projection (qkv_proj, gate_up_proj + SiLU·mul) reads that rounded stream and scales each row of
  its float32 sums by 1 / rms from those sums of squares before its epilogue (`DecodeLinear.scaled`,
  `scaled_silu_mul`).

So a folded decode step launches two norms in all (the first layer's, which starts the stream from the
embedding rows, and the final one) instead of two per layer. The rounding moves: the norm no longer rounds
x / rms before multiplying by g; the GEMM input is the stream rounded to the model dtype (the same relative
error), and W diag(g) is rounded once.

It applies where the small-M table runs o_proj and down_proj (direct or split-K) and gate_up + SiLU·mul on a
Triton kernel, at the same batch buckets (`LlamaForCausalLM.fold_buckets`); qkv_proj runs the direct kernel
there. Not with biases, LoRA (adapters see the normalized input), a half-precision residual stream, float32
activations, or SITS_FOLD_NORMS=0. Quantized, compiled and tensor-parallel models never get the table.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sits.runtime.env_switch import env_switch
from sits.runtime.models.small_m_linear import DecodeLinear, fold_kernels

logger = logging.getLogger(__name__)

FOLD_ENV = "SITS_FOLD_NORMS"


def fold_buckets(model: nn.Module) -> frozenset[int]:
    """The M buckets at which `model`'s decode steps can run with folded norms (empty: none, or a model this does
    not apply to; see the module doc). Host-side, from the installed buckets only."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or getattr(model, "residual_dtype", None) != torch.float32:
        return frozenset()
    if getattr(model, "activation_dtype", None) is not None:
        return frozenset()
    buckets: frozenset[int] | None = None
    for layer in layers:
        linears = _projections(layer)
        if linears is None or any(m.bias is not None or m._forward_hooks or m._forward_pre_hooks for m in linears):
            return frozenset()
        _, o_proj, gate_up, down = linears
        here = o_proj.direct_buckets & down.direct_buckets & gate_up.silu_mul_buckets
        buckets = here if buckets is None else buckets & here
    return buckets or frozenset()


def _projections(layer: nn.Module) -> tuple[DecodeLinear, ...] | None:
    """(qkv_proj, o_proj, gate_up_proj, down_proj) of a Llama decoder layer when all four are DecodeLinear."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    linears = (getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None), getattr(mlp, "gate_up_proj", None),
               getattr(mlp, "down_proj", None))
    return linears if all(isinstance(m, DecodeLinear) for m in linears) else None


def nearest_pinned(pinned: dict[int, dict[str, int]], bucket: int) -> dict[str, int] | None:
    """The pinned config of the bucket nearest `bucket` (in powers of two; the smaller on a tie), or None."""
    if not pinned:
        return None
    return pinned[min(pinned, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))]


def fold_decoder_norms(model: nn.Module) -> frozenset[int]:
    """Fold every decoder norm of `model` into the projection it feeds and mark the buckets whose decode steps skip
    the norm launches (see the module doc); at start-up, after the small-M table is installed and before the
    kernels' pre-tune. Returns the buckets (empty: no step folds). Folding twice changes nothing (the norms
    are 1 by then); with SITS_FOLD_NORMS=0 a model folded before keeps its weights (the same model) but no step
    takes the folded path."""
    buckets = frozenset() if env_switch(FOLD_ENV) is False else fold_buckets(model)
    if buckets:
        with torch.no_grad():
            for layer in model.model.layers:
                qkv, _, gate_up, _ = _projections(layer)
                _fold(layer.input_layernorm, qkv)
                _fold(layer.post_attention_layernorm, gate_up)
        logger.info("decoder norms folded into the projections: decode batches in M buckets %s launch no norm per "
                    "layer", sorted(buckets))
    if buckets or getattr(model, "fold_buckets", None):
        _mark(model, buckets)
    return buckets


def _mark(model: nn.Module, buckets: frozenset[int]) -> None:
    """Give the model and each layer's projections their fold buckets, roles and kernels (empty: unmarked)."""
    for layer in model.model.layers:
        qkv, o_proj, gate_up, down = _projections(layer)
        kernels = fold_kernels(qkv.weight.device)
        for linear, role in ((qkv, "scale"), (o_proj, "stream"), (gate_up, "scale_silu_mul"), (down, "stream")):
            linear.fold_buckets, linear.fold_role, linear._fold_kernels = buckets, role if buckets else "", kernels
        direct_pins = {b: c for b, c in qkv.pinned.items() if b not in qkv.splitk_buckets}
        nearest = {b: nearest_pinned(direct_pins, b) for b in buckets if b not in direct_pins}
        qkv.fold_pinned = {b: config for b, config in nearest.items() if config is not None}
    model.fold_buckets = buckets


def _fold(norm: nn.Module, linear: DecodeLinear) -> None:
    """W <- W diag(g) (in float32, rounded once to W's dtype) and g <- 1."""
    scaled = linear.weight.float() * norm.weight.float()[None, :]
    linear.weight.copy_(scaled.to(linear.weight.dtype))
    norm.weight.fill_(1.0)
