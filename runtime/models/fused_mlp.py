"""SITS_FUSED_MLP=1: a folded decode layer's MLP (gate_up + SiLU·mul, then down_proj into the residual stream) as one
persistent launch (sits.kernels.fused_mlp) instead of two.

It applies where the norms are folded (runtime/models/norm_fold.py) and the batch has at most fused_mlp.MAX_ROWS
rows, on a CUDA device whose multiprocessors hold the launch's whole grid at once (checked once at start-up). It
computes what the two launches compute, bit for bit at the same tiles (tests/kernels/test_fused_mlp.py); the
tiles are the fused launch's own, so against the table's pinned launches the sums may differ in their last bits.
Off by default (FUSED_MLP_DEFAULT) until a GPU has timed it against the two launches (`prof1-fmlp` in
benchmarks/gpu_profile_run.sh, benchmarks/bench_fused_mlp.py); SITS_FUSED_MLP=0 / 1 overrides.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sits.kernels.fused_mlp import (
    DEFAULT_CONFIG,
    MAX_ROWS,
    FusedMlpWork,
    config_divides,
    fits_at_once,
    fused_decode_mlp,
)
from sits.kernels.gemm_small_m import sumsq_slots
from sits.runtime.env_switch import env_switch

logger = logging.getLogger(__name__)

FUSED_MLP_ENV = "SITS_FUSED_MLP"
FUSED_MLP_DEFAULT = False


class FusedDecodeMlp:
    """The launch's buffers and config for one model (its layers run one after another on one stream, so they share
    them); `takes` says whether a decode batch runs it, calling it runs it."""

    def __init__(self, work: FusedMlpWork, config: dict) -> None:
        self.work = work
        self.config = config

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the rows x [M, K] (the rounded stream) run the fused launch."""
        return x.shape[0] <= MAX_ROWS and x.dtype == self.work.h.dtype and x.device == self.work.h.device

    def __call__(self, mlp: nn.Module, x: torch.Tensor, sumsq: torch.Tensor, eps: float,
                 stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`mlp.down_proj.to_stream(mlp.gate_up_proj.scaled_silu_mul(x, sumsq, eps), stream)` in one launch: stream
        updated in place; returns (the new stream rounded to x's dtype, its sums of squares)."""
        return fused_decode_mlp(x, sumsq, eps, mlp.gate_up_proj.weight, mlp.down_proj.weight, stream, self.work,
                                self.config)


def install_fused_mlp(model: nn.Module, config: dict | None = None) -> FusedDecodeMlp | None:
    """At start-up, after fold_decoder_norms: give every layer's MLP the fused launch (at `config`, default
    DEFAULT_CONFIG) when SITS_FUSED_MLP (else FUSED_MLP_DEFAULT) says so, the model's decode steps fold their norms,
    the config's tiles divide the model's shapes and its grid fits the GPU at once. Returns it (None: not
    installed, and the MLPs keep their two launches)."""
    switch = env_switch(FUSED_MLP_ENV)
    if not (FUSED_MLP_DEFAULT if switch is None else switch) or not getattr(model, "fold_buckets", None):
        return None
    config = DEFAULT_CONFIG if config is None else config
    mlp = model.model.layers[0].mlp
    w_gate_up, w_down = mlp.gate_up_proj.weight, mlp.down_proj.weight
    hidden, intermediate = w_down.shape
    device, dtype = w_down.device, w_down.dtype
    if not config_divides(config, hidden, intermediate, hidden):
        logger.warning("%s=1: the fused MLP's tiles %s do not divide hidden %d / intermediate %d; the MLP runs as two "
                       "launches", FUSED_MLP_ENV, config, hidden, intermediate)
        return None
    work = FusedMlpWork.new(hidden, intermediate, dtype, device)
    x = torch.zeros(1, hidden, dtype=dtype, device=device)
    sumsq = torch.ones(1, sumsq_slots(hidden), dtype=torch.float32, device=device)
    stream = torch.zeros(1, hidden, dtype=torch.float32, device=device)
    if not fits_at_once(x, sumsq, 1e-5, w_gate_up, w_down, stream, work, config):
        logger.warning("%s=1: the fused MLP's grid does not fit this GPU at once; the MLP runs as two launches",
                       FUSED_MLP_ENV)
        return None
    fused = FusedDecodeMlp(work, config)
    for layer in model.model.layers:
        layer.mlp.fused_decode = fused
    logger.info("decode MLPs of up to %d rows run as one launch (%s)", MAX_ROWS, FUSED_MLP_ENV)
    return fused
