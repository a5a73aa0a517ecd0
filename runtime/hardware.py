"""What GPU the engine runs on, and the engine limits that suit it.

`detect_gpu()` names the device (A100, H100, H200 or other) and carries its memory and the rates a
roofline needs (HBM bandwidth, dense bf16 / fp8 matrix rates). The rates of the H200 are the ones
measured on the project's H200 (BASELINES.md); the others are datasheet figures scaled the same way.

`engine_defaults()` picks the step token budget, the sequences running at once and the largest
CUDA-graph batch from the device's memory: a large HBM holds the KV cache of many sequences, and a
fast one wants big decode batches to turn weight reads into useful work. Every value is logged with
its reason and a flag overrides it.

Throughput mode: fp8 weights with an fp8 KV cache on an H200-class GPU (SM 9.x, >= 120 GiB free)
hold several hundred long sequences (Llama-3-8B: ~9 GiB of weights, 64 KiB of KV per token, so
~110 GiB of cache is ~450 sequences of 4,096 tokens), so the limits grow to match: 512 sequences,
16,384 batched tokens and CUDA graphs up to batch 512 (`THROUGHPUT_DEFAULTS`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class GpuProfile:
    """One CUDA device.

    Attributes:
        name: the device name CUDA reports.
        family: "H200", "H100", "A100" or "other".
        memory_bytes: the device's memory.
        free_bytes: free when detected.
        hbm_bytes_per_s: achievable memory bandwidth (read + write), bytes/s.
        bf16_flops: achievable dense bf16 matrix rate, FLOP/s.
        fp8_flops: achievable dense fp8 matrix rate, FLOP/s (None before Hopper).
        multiprocessors: streaming multiprocessors.
        capability: CUDA compute capability (major, minor); (0, 0) when unknown.
    """

    name: str
    family: str
    memory_bytes: int
    free_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float | None
    multiprocessors: int
    capability: tuple[int, int] = (0, 0)


# family -> (HBM bytes/s, bf16 FLOP/s, fp8 FLOP/s); H200 measured (BASELINES.md), others scaled alike.
_RATES = {
    "H200": (4.29e12, 785e12, 1430e12),
    "H100": (3.0e12, 760e12, 1400e12),
    "A100": (1.75e12, 280e12, None),
}


def _family(name: str) -> str:
    upper = name.upper()
    for family in ("H200", "H100", "A100"):
        if family in upper:
            return family
    return "other"


def detect_gpu(device: torch.device | str | int = 0) -> GpuProfile | None:
    """The CUDA device's profile, or None without CUDA."""
    import torch  # here, not at the top: `sits serve` checks its flags before torch is imported

    if not torch.cuda.is_available():
        return None
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    family = _family(props.name)
    hbm, bf16, fp8 = _RATES.get(family, (1.0e12, 100e12, None))
    return GpuProfile(props.name, family, total, free, hbm, bf16, fp8, props.multi_processor_count,
                      (props.major, props.minor))


@dataclass(frozen=True)
class EngineDefaults:
    """Limits for the engine, with the reason they were chosen.

    Attributes:
        max_num_batched_tokens: new tokens per step (prefill chunks + decodes).
        max_num_seqs: sequences running at once.
        cuda_graph_max_batch_size: the largest decode batch captured in a CUDA graph.
        reason: one line for the log.
        max_prefill_tokens_with_decodes: prompt tokens a step may add to running decodes (the
            decodes' latency budget, `SchedulerConfig`); 0: no cap beyond max_num_batched_tokens.
        prefill_cap_min_decodes: the budget applies to steps with at least this many decodes.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    cuda_graph_max_batch_size: int
    reason: str
    max_prefill_tokens_with_decodes: int = 0
    prefill_cap_min_decodes: int = 0


CPU_DEFAULTS = EngineDefaults(512, 32, 32, "CPU: a few cores, small steps")

# (max_num_batched_tokens, max_num_seqs, cuda_graph_max_batch_size) of throughput mode. 512 running
# decodes leave ~15.9k tokens of each step's budget to prefill chunks, so a batch of 512 prompts of
# 2,048 tokens is prefilled in ~66 steps; the largest activation (the gate/up output, 16,384 x 28,672
# bf16) is 0.9 GiB.
THROUGHPUT_DEFAULTS = (16384, 512, 512)
THROUGHPUT_MIN_FREE_GIB = 120
DECODE_PREFILL_BUDGET = 768  # prompt tokens a GPU step may add beside 64+ running decodes (see engine_defaults)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def throughput_mode(profile: GpuProfile | None, quantization: str, kv_cache_dtype: str) -> bool:
    """Whether the throughput-mode limits apply: fp8 weights and an fp8 KV cache on an SM 9.x GPU
    with at least THROUGHPUT_MIN_FREE_GIB GiB free (an H200; an 80 GiB H100 holds half the cache)."""
    return (profile is not None and quantization == "fp8" and kv_cache_dtype in FP8_KV_CACHE_DTYPES
            and profile.capability[0] == 9 and profile.free_bytes >= THROUGHPUT_MIN_FREE_GIB * GIB)


def engine_defaults(profile: GpuProfile | None, quantization: str = "none", kv_cache_dtype: str = "auto"
                    ) -> EngineDefaults:
    """The limits that suit a device (CPU_DEFAULTS when profile is None).

    Args:
        profile: the device (detect_gpu), or None on the CPU.
        quantization: --quantization ("none", "fp8", "int8").
        kv_cache_dtype: --kv-cache-dtype ("auto" or "fp8"); with fp8 weights on an H200-class GPU an
            fp8 cache turns on throughput mode (`throughput_mode`).
    """
    if profile is None:
        return CPU_DEFAULTS
    free_gib = profile.free_bytes / GIB
    if throughput_mode(profile, quantization, kv_cache_dtype):
        tokens, seqs, graphs = THROUGHPUT_DEFAULTS
        reason = (f"{profile.name} (SM {profile.capability[0]}.{profile.capability[1]}, {free_gib:.0f} GiB free, "
                  f"{profile.multiprocessors} SMs): throughput mode, fp8 weights with an fp8 KV cache")
        return EngineDefaults(tokens, seqs, graphs, reason)
    if profile.family in ("H200", "H100") and free_gib >= 60:
        tokens, seqs, graphs = 8192, 256, 256
    elif free_gib >= 60:
        tokens, seqs, graphs = 8192, 256, 128
    elif free_gib >= 30:
        tokens, seqs, graphs = 4096, 128, 128
    else:
        tokens, seqs, graphs = 2048, 64, 64
    reason = (f"{profile.name} ({profile.family}, {profile.memory_bytes / GIB:.0f} GiB, "
              f"{free_gib:.0f} GiB free, {profile.multiprocessors} SMs)")
    # The decode latency budget, on by default on GPUs: at most 768 prompt tokens in a step beside 64 or
    # more decodes. Measured on an H200 (Llama-3-8B shape, bf16, benchmarks/RESULTS.md): without it a mixed
    # step of 8,192 prompt tokens takes ~200 ms against 17 ms for a decode step. At 256 streams (1,024 /
    # 512, 2026-12-02 afternoon, served and offline with the same budget): 1,024 tokens gave served ITL
    # p99 / p50 of 4.89 and 4.19 and offline 6,661-6,712 tok/s; 768 gave 2.61 and 3.27 and offline
    # 7,403-8,126; 512 prefilled only about as fast as new streams arrived (served 0.77x of offline). Beside
    # fewer decodes (a burst of new prompts, batch 32) prompts still fill the step, so time to first token
    # and batch-32 throughput keep the full budget. Throughput mode (above) leaves it off: there a batch's
    # own prefill is the work. 0 turns it off.
    return EngineDefaults(tokens, seqs, graphs, reason, max_prefill_tokens_with_decodes=DECODE_PREFILL_BUDGET,
                          prefill_cap_min_decodes=64)


def log_defaults(defaults: EngineDefaults, overridden: dict[str, object]) -> None:
    """One info line: the chosen limits, which flags overrode them, and why."""
    chosen = (f"max_num_batched_tokens {defaults.max_num_batched_tokens}, max_num_seqs {defaults.max_num_seqs}, "
              f"CUDA graphs up to batch {defaults.cuda_graph_max_batch_size}, max_prefill_tokens_with_decodes "
              f"{defaults.max_prefill_tokens_with_decodes} beside {defaults.prefill_cap_min_decodes}+ decodes")
    flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in overridden.items() if v is not None)
    logger.info("hardware defaults for %s: %s%s", defaults.reason, chosen, f" (overridden: {flags})" if flags else "")
