"""Engine flags shared by `sits serve` and `sits generate`, and the EngineConfig they build.

Flags a user leaves out stay None here and get a default that suits the device: a CPU has a few
cores and no HBM, so it batches fewer tokens per step and runs fewer sequences at once; a GPU's
defaults come from its kind and free memory (`sits.runtime.hardware`), logged with the reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sits.runtime.config import (
    ACTIVATION_DTYPES,
    ATTENTION_BACKENDS,
    DTYPES,
    FP8_MODES,
    KV_CACHE_DTYPES,
    KV_CACHE_SCALES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from sits.runtime.lora.config import RUNTIME_UPDATING_ENV, LoraConfig, LoraConfigError, parse_lora_module
from sits.runtime.parallel.cli_args import add_parallel_arguments, parallel_config_from_args

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag that builds an EngineConfig: the model, the engine, LoRA, parallelism, the log level."""
    _add_model_arguments(parser)
    _add_engine_group(parser)
    add_lora_arguments(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What is loaded and how: checkpoint or dummy shape, dtype, device, quantization."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH|URI",
                       help="HF directory, .gguf file or hf://org/name[@revision] "
                            "(default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--load-format", default=None, choices=LOAD_FORMATS,
                       help="auto: read the checkpoint --model names; dummy: seeded random weights of the shape "
                            "--config names, served with the token-id tokenizer (prompts and outputs are token "
                            "ids written as text, '17 42 9'); no checkpoint is read (default: auto)")
    model.add_argument("--config", default=None, metavar="NAME", dest="config",
                       help="a named model shape for --load-format dummy (llama-3-8b, llama-3.1-8b, llama-2-7b, "
                            "smollm2-135m, tiny)")
    model.add_argument("--served-model-name", default=None, help="the OpenAI model id (default: the model's name)")
    model.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on CUDA")
    model.add_argument("--activation-dtype", default="auto", choices=ACTIVATION_DTYPES,
                       help="auto: the activations in --dtype; float32: activations stay float32 between the "
                            "kernels of a bfloat16 / float16 model (weights and KV cache stay in --dtype, each "
                            "projection multiplies two half-precision parts of its input): greedy outputs close "
                            "to a float32 model's at the half-precision model's memory; prefill GEMMs do twice "
                            "the work (docs/precision.md)")
    model.add_argument("--device", default="auto", help="auto, cpu or cuda (auto: cuda when available)")
    model.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per sequence")
    model.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                       help="fp8: e4m3 weights with per-channel scales and per-token activation scales; "
                            "int8: weight-only with per-group scales")
    model.add_argument("--fp8-mode", default="auto", choices=FP8_MODES,
                       help="with --quantization fp8: w8a8 (activations quantized per token, fp8 tensor cores), "
                            "weight-only (bf16 activations, fp8 weights dequantized in the GEMM's load) or auto "
                            "(weight-only on GPUs without fp8 tensor cores, before SM 8.9)")
    model.add_argument("--seed", type=int, default=0, help="seed for requests that give none")


def _add_engine_group(parser: argparse.ArgumentParser) -> None:
    """How the engine runs the model: budgets, the KV cache, scheduling, graphs, speculation."""
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help="sequences running at once (CPU: 32; GPU: from the GPU and its free memory)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="new tokens per engine step (CPU: 512; GPU: from the GPU, e.g. 8192 on an H100/H200)")
    engine.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="tokens per KV block")
    engine.add_argument("--kv-cache-gb", type=float, default=CacheConfig.kv_cache_gb, help="KV cache on CPU, GiB")
    engine.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization,
                        help="fraction of GPU memory for weights, activations and KV cache")
    engine.add_argument("--num-blocks", type=int, default=None, help="exact KV block count (overrides budgets)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse KV blocks of earlier prompts")
    engine.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None, metavar="N",
                        help="latency budget of running decodes: a step that runs decodes adds at most N prompt "
                             "tokens (longer prompts are chunked across steps); 0: no cap; default: the device's")
    engine.add_argument("--prefill-cap-min-decodes", type=int, default=None, metavar="M",
                        help="apply --max-prefill-tokens-with-decodes only to steps running at least M decodes "
                             "(a burst of new prompts beside few decodes prefills at full speed); default: the "
                             "device's")
    engine.add_argument("--host-kv-cache-gb", type=float, default=CacheConfig.host_kv_cache_gb,
                        help="host-memory tier for evicted prefix-cache blocks, GiB (0: off)")
    add_kv_cache_dtype_arguments(engine)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split long prompts across steps")
    engine.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: decode steps run eagerly too")
    engine.add_argument("--cuda-graph-max-batch-size", type=int, default=None,
                        help="largest decode batch captured in a CUDA graph (default: from the GPU, at most "
                             "--max-num-seqs)")
    engine.add_argument("--piecewise-graph-max-tokens", type=int, default=None, metavar="N",
                        help="steps with prompt tokens of up to N tokens replay CUDA graphs between their "
                             "attention calls (default: --max-num-seqs plus the decodes' prompt-token budget, "
                             "at least 2048; 0: they run eagerly)")
    engine.add_argument("--compile", action="store_true",
                        help="torch.compile the norms and MLPs (attention stays on its back end)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and prepare the next step while the GPU computes the current one "
                             "(default: on for one CUDA device, off on CPU)")
    engine.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)')


def add_kv_cache_dtype_arguments(engine: argparse._ArgumentGroup) -> None:
    """--kv-cache-dtype and --kv-cache-scales (docs/fp8-kv-cache.md)."""
    engine.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; fp8 (or fp8_e4m3): float8 e4m3 with per-layer, per-KV-head "
                             "scales, half the bytes per token, so twice the blocks (docs/fp8-kv-cache.md)")
    engine.add_argument("--kv-cache-scales", default=CacheConfig.kv_cache_scales, choices=KV_CACHE_SCALES,
                        help="scales of an fp8 cache: static (1.0 per head, as vLLM without checkpoint scales) or "
                             "calibrate (each head's amax over a calibration prompt at start-up)")


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's multi-LoRA flags: requests pick an adapter by sending its name as `model`."""
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model")
    lora.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                      help='PEFT adapter directories served as model NAME (or JSON: {"name": ..., "path": ..., '
                           '"base_model_name": ...}); all are loaded at start-up')
    lora.add_argument("--max-loras", type=int, default=None,
                      help="adapter slots (adapters in one batch); at least the number of --lora-modules, "
                           "which is the default")
    lora.add_argument("--max-lora-rank", type=int, default=LoraConfig.max_lora_rank, help="largest adapter rank")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load adapters "
                           f"into free --max-loras slots and unload them while serving (or {RUNTIME_UPDATING_ENV}=1)")


def lora_config_from_args(args: argparse.Namespace) -> LoraConfig:
    """The LoRA options; a malformed --lora-modules value is a ConfigError naming it. The environment's
    SITS_ALLOW_RUNTIME_LORA_UPDATING=1 counts as --allow-runtime-lora-updating with --enable-lora."""
    try:
        modules = [parse_lora_module(value) for value in getattr(args, "lora_modules", None) or ()]
    except LoraConfigError as error:
        raise ConfigError(str(error)) from None
    return LoraConfig(enable_lora=getattr(args, "enable_lora", False), modules=modules,
                      max_loras=getattr(args, "max_loras", None),
                      max_lora_rank=getattr(args, "max_lora_rank", LoraConfig.max_lora_rank),
                      allow_runtime_updating=getattr(args, "allow_runtime_lora_updating", False)
                      or (getattr(args, "enable_lora", False)
                          and os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true")))


NVIDIA_DRIVER_NODE = "/dev/nvidiactl"  # present wherever the NVIDIA driver can serve CUDA


def surely_cpu(device: str) -> bool:
    """True when the engine will run on the CPU, known without importing torch: `--device cpu`, or
    `auto` on a host without the NVIDIA driver (or with CUDA_VISIBLE_DEVICES empty or -1)."""
    if device == "cpu":
        return True
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return device == "auto" and (not os.path.exists(NVIDIA_DRIVER_NODE) or visible is not None
                                 and visible.strip() in ("", "-1"))


def _on_cpu(device: str) -> bool:
    if surely_cpu(device):
        return True
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return False


def device_defaults(device: str, quantization: str = "none", kv_cache_dtype: str = "auto"):
    """The limits (`sits.runtime.hardware.EngineDefaults`) that suit the device the engine will run on
    (fp8 weights with an fp8 KV cache on an H200-class GPU: throughput mode)."""
    from sits.runtime.hardware import CPU_DEFAULTS, detect_gpu, engine_defaults

    return CPU_DEFAULTS if _on_cpu(device) else engine_defaults(detect_gpu(), quantization, kv_cache_dtype)


def engine_config_from_args(args: argparse.Namespace, chosen=None) -> EngineConfig:
    """The validated EngineConfig; raises ConfigError naming the flag.

    `chosen`: the `EngineDefaults` for what the flags leave unset; None: the device's
    (`device_defaults`, which imports torch and probes CUDA unless the engine surely runs on the CPU)."""
    from sits.runtime.hardware import CPU_DEFAULTS, log_defaults

    chosen = chosen or device_defaults(args.device, args.quantization, getattr(args, "kv_cache_dtype", None) or "auto")
    defaults = {"max_num_seqs": chosen.max_num_seqs, "max_num_batched_tokens": chosen.max_num_batched_tokens}
    graph_max = getattr(args, "cuda_graph_max_batch_size", None)
    if chosen is not CPU_DEFAULTS:
        log_defaults(chosen, {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                              "cuda_graph_max_batch_size": graph_max,
                              "max_prefill_tokens_with_decodes": getattr(args, "max_prefill_tokens_with_decodes",
                                                                         None),
                              "prefill_cap_min_decodes": getattr(args, "prefill_cap_min_decodes", None)})
    config = EngineConfig(
        model=ModelConfig(model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
                          device=args.device, max_model_len=args.max_model_len, quantization=args.quantization,
                          fp8_mode=getattr(args, "fp8_mode", "auto"),
                          seed=args.seed, load_format=getattr(args, "load_format", None) or "auto",
                          config_name=getattr(args, "config", None),
                          activation_dtype=getattr(args, "activation_dtype", None) or "auto"),
        cache=CacheConfig(block_size=args.block_size, kv_cache_gb=args.kv_cache_gb,
                          gpu_memory_utilization=args.gpu_memory_utilization, num_blocks=args.num_blocks,
                          enable_prefix_caching=args.enable_prefix_caching,
                          host_kv_cache_gb=args.host_kv_cache_gb,
                          kv_cache_dtype=getattr(args, "kv_cache_dtype", CacheConfig.kv_cache_dtype),
                          kv_cache_scales=getattr(args, "kv_cache_scales", CacheConfig.kv_cache_scales)),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs if args.max_num_seqs is not None else defaults["max_num_seqs"],
            max_num_batched_tokens=(args.max_num_batched_tokens if args.max_num_batched_tokens is not None
                                    else defaults["max_num_batched_tokens"]),
            enable_chunked_prefill=args.enable_chunked_prefill,
            max_prefill_tokens_with_decodes=_flag_or_default(args, chosen, "max_prefill_tokens_with_decodes"),
            prefill_cap_min_decodes=_flag_or_default(args, chosen, "prefill_cap_min_decodes")),
        parallel=parallel_config_from_args(args),
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_batch_size=graph_max if graph_max is not None else chosen.cuda_graph_max_batch_size,
        piecewise_graph_max_tokens=getattr(args, "piecewise_graph_max_tokens", None),
        compile=getattr(args, "compile", False),
        async_scheduling=getattr(args, "async_scheduling", None),
        lora=lora_config_from_args(args),
        speculative=_speculative_config(getattr(args, "speculative_config", None)),
    )
    config.validate()
    return config


def _flag_or_default(args: argparse.Namespace, chosen, name: str) -> int:
    """The flag `--name` when given, else the device's `EngineDefaults` field of that name (the decodes'
    latency budget)."""
    flagged = getattr(args, name, None)
    return flagged if flagged is not None else getattr(chosen, name)


def _speculative_config(value: str | None) -> SpeculativeConfig | None:
    """--speculative-config's JSON; a ConfigError naming the flag when malformed."""
    return SpeculativeConfig.from_json(value) if value is not None else None


def fail(prog: str, message: str) -> int:
    """A user error as one line on stderr; exit code 2 (as argparse uses for bad flags)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


__all__ = ["ConfigError", "add_engine_arguments", "configure_logging", "engine_config_from_args", "fail"]
