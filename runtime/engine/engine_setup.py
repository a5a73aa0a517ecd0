"""Putting a loaded model to work before the engine's first step: quantization, the activations' dtype,
torch.compile, the small-M GEMM's table, the kernels' pre-tune (`kernel_warmup.py`) and CUDA-graph capture
(with the reason in the log when graphs are off), and the checkpoint's head size that picks the attention
back end.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sits.runtime.config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from sits.runtime.engine.runner import ModelRunner
    from sits.runtime.models.loading import LoadedModel

logger = logging.getLogger(__name__)


def quantize(loaded: LoadedModel, method: str, fp8_mode: str = "auto") -> None:
    """Convert the model's linear layers for --quantization (and --fp8-mode; a no-op when already converted)."""
    if method == "none":
        return
    from sits.runtime.models.quantize import quantization_of, quantize_model

    current = quantization_of(loaded.model)
    if current == method:
        return
    if current != "none":
        raise ConfigError(f"--quantization {method}: the model is already quantized to {current}")
    quantize_model(loaded.model, method, fp8_mode=fp8_mode)


def use_activation_dtype(loaded: LoadedModel, name: str) -> None:
    """--activation-dtype: "auto" runs the activations in the model's dtype; "float32" keeps a half-precision
    model's activations in float32 (`LlamaForCausalLM.use_activation_dtype`; a float32 model already runs so).
    Set at every engine's start, so engines sharing one loaded model (tests) each get their own choice."""
    import torch

    use = getattr(loaded.model, "use_activation_dtype", None)
    if use is None:
        if name != "auto":
            raise ConfigError(f"--activation-dtype {name}: {type(loaded.model).__name__} does not support it")
        return
    use(None if name == "auto" else getattr(torch, name))
    if name != "auto" and loaded.dtype != torch.float32:
        logger.info("activations in %s beside %s weights and KV cache", name, str(loaded.dtype).removeprefix("torch."))


def prepare_execution(runner: ModelRunner, loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> None:
    """torch.compile (--compile), the small-M GEMM's measured table (on CUDA: small_m_linear.py), the
    pre-tune of every kernel key the steps can reach (on CUDA, with or without --enforce-eager: eager
    steps launch the same kernels) and CUDA-graph capture of decode steps and, piecewise, of steps with
    prompt tokens, with the reason when graphs are off."""
    from sits.runtime.engine.cuda_graphs import decode_batch_sizes

    if config.compile:
        from sits.runtime.engine.compilation import compile_non_attention

        compile_non_attention(loaded.model)
    if loaded.device.type == "cuda":
        from sits.runtime.engine.kernel_warmup import pretune_kernels
        from sits.runtime.models.small_m_linear import enable_small_m_gemm

        enable_small_m_gemm(loaded.model, loaded.device, compiled=config.compile)  # before its pre-tune
        if getattr(runner, "lora", None) is None:  # adapters read the normalized rows: the norms stay
            from sits.runtime.models.fused_mlp import install_fused_mlp
            from sits.runtime.models.norm_fold import fold_decoder_norms

            fold_decoder_norms(loaded.model)
            install_fused_mlp(loaded.model)
        activations = getattr(loaded.model, "activation_dtype", None) or loaded.dtype  # queries, GEMM inputs
        pretune_kernels(runner, activations, config.scheduler, max_model_len)
    backend = getattr(loaded.model, "backend", None)
    if loaded.device.type != "cuda":
        reason = "not on CUDA"
    elif config.enforce_eager:
        reason = "--enforce-eager"
    elif backend is None or not getattr(backend, "supports_cuda_graphs", False):
        reason = f"the {getattr(backend, 'name', '?')} attention back end cannot be captured"
    elif getattr(runner, "lora", None) is not None:
        reason = "LoRA adapters are applied eagerly"
    elif not runner.cuda_graphs_supported:
        reason = f"{type(runner).__name__} does not support them"
    else:
        sizes = decode_batch_sizes(config.scheduler.max_num_seqs, config.cuda_graph_max_batch_size)
        runner.setup_cuda_graphs(sizes, max_model_len)
        _setup_piecewise_graphs(runner, backend, config)
        return
    logger.info("CUDA graphs off (%s): every step runs eagerly", reason)


def _setup_piecewise_graphs(runner: ModelRunner, backend, config: EngineConfig) -> None:
    """Piecewise graphs for steps with prompt tokens (after the decode graphs), where the back end allows."""
    from sits.runtime.engine.piecewise_graphs import piecewise_token_sizes

    max_tokens = config.piecewise_max_tokens
    if not max_tokens:
        logger.info("piecewise CUDA graphs off (--piecewise-graph-max-tokens 0): steps with prompt tokens "
                    "run eagerly")
    elif not getattr(backend, "supports_piecewise_graphs", False):
        logger.info("piecewise CUDA graphs off (the %s attention back end cannot run between graphs): steps "
                    "with prompt tokens run eagerly", getattr(backend, "name", "?"))
    else:
        try:
            runner.setup_piecewise_graphs(piecewise_token_sizes(max_tokens))
        except Exception as error:  # noqa: BLE001 - a model the pieces cannot capture still serves, eagerly
            runner.piecewise_graphs = None
            logger.warning("piecewise CUDA graphs off: capturing them failed (%s: %s); steps with prompt tokens "
                           "run eagerly", type(error).__name__, error)
            return
        _verify_piecewise_graphs(runner)


PIECEWISE_TOLERANCE = 0.05  # max |replay - eager| / max |eager| of the final hidden states; a wrong buffer is O(1)


def _verify_piecewise_graphs(runner: ModelRunner) -> None:
    """Replay against the eager forward once; piecewise graphs off (a warning) if they disagree."""
    graphs = runner.piecewise_graphs
    assert graphs is not None
    errors = graphs.verify(runner.model.config.vocab_size)
    figures = ", ".join(f"{error:.1e} at {size} tokens" for size, error in errors.items())
    if all(error <= PIECEWISE_TOLERANCE for error in errors.values()):  # a NaN fails too
        logger.info("piecewise CUDA graphs: replay against the eager forward: %s (max |difference| / max "
                    "|value| of the hidden states)", figures or "no bucket fits the cache")
        return
    runner.piecewise_graphs = None
    logger.warning("piecewise CUDA graphs off: their replay differed from the eager forward (%s; tolerance %s); "
                   "steps with prompt tokens run eagerly", figures, PIECEWISE_TOLERANCE)


def checkpoint_head_dim(config: EngineConfig, progress: bool) -> int:
    """The checkpoint's head size, read before loading so the attention back end can be chosen."""
    from sits.runtime.models import loading

    return loading.read_model_config(config.model, progress=progress).head_dim
