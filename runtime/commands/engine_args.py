"""Engine flags shared by `sits serve` and `sits generate`, and the EngineConfig they build.

Flags a user leaves out stay None here and get a default that suits the device: a CPU has a few
cores and no HBM, so it batches fewer tokens per step and runs fewer sequences at once.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sits.runtime.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)

LOG_LEVELS = ("debug", "info", "warning", "error")
CPU_DEFAULTS = {"max_num_batched_tokens": 512, "max_num_seqs": 32}
GPU_DEFAULTS = {"max_num_batched_tokens": SchedulerConfig.max_num_batched_tokens,
                "max_num_seqs": SchedulerConfig.max_num_seqs}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--served-model-name", default=None, help="the OpenAI model id (default: the model's name)")
    model.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on CUDA")
    model.add_argument("--device", default="auto", help="auto, cpu or cuda (auto: cuda when available)")
    model.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per sequence")
    model.add_argument("--quantization", default="none", help="none, fp8 or int8 (GPU)")
    model.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once (CPU: 32)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="new tokens per engine step (CPU: 512, GPU: 2048)")
    engine.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="tokens per KV block")
    engine.add_argument("--kv-cache-gb", type=float, default=CacheConfig.kv_cache_gb, help="KV cache on CPU, GiB")
    engine.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization,
                        help="fraction of GPU memory for weights, activations and KV cache")
    engine.add_argument("--num-blocks", type=int, default=None, help="exact KV block count (overrides budgets)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse KV blocks of earlier prompts")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="split long prompts across steps")
    engine.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)


def _on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return False


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The validated EngineConfig; raises ConfigError naming the flag."""
    defaults = CPU_DEFAULTS if _on_cpu(args.device) else GPU_DEFAULTS
    config = EngineConfig(
        model=ModelConfig(model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
                          device=args.device, max_model_len=args.max_model_len, quantization=args.quantization,
                          seed=args.seed),
        cache=CacheConfig(block_size=args.block_size, kv_cache_gb=args.kv_cache_gb,
                          gpu_memory_utilization=args.gpu_memory_utilization, num_blocks=args.num_blocks,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs if args.max_num_seqs is not None else defaults["max_num_seqs"],
            max_num_batched_tokens=(args.max_num_batched_tokens if args.max_num_batched_tokens is not None
                                    else defaults["max_num_batched_tokens"]),
            enable_chunked_prefill=args.enable_chunked_prefill),
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
    )
    config.validate()
    return config


def fail(prog: str, message: str) -> int:
    """A user error as one line on stderr; exit code 2 (as argparse uses for bad flags)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


__all__ = ["ConfigError", "add_engine_arguments", "configure_logging", "engine_config_from_args", "fail"]
