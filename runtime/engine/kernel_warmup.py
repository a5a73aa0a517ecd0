"""The start-up pre-tune: every Triton kernel key an engine can reach, tuned before the first request.

A Triton autotuner benchmarks all its configs the first time it sees a key (and compiles them on a
fresh machine); on live traffic that stalls every stream of the engine for seconds (16.2 s for
one step on an H200: the first mixed step whose decodes passed a context of 1,024). So once the
model is loaded and its KV cache allocated, before CUDA-graph capture, `pretune_kernels` launches
the attention back end's prefill kernel for every query-length bucket, its decode kernel for every
split plan (through `rope_write_attend`, as decode steps call it, so a fused RoPE variant compiles
too), the quantized GEMMs for every row bucket (with --quantization fp8 / int8) and the small-M direct
GEMM (and its fused norm) for every bucket its measured table gave a layer: the launches of
`tuning_plan`, on dummy inputs that read the real cache and write nothing into it.

Triton's on-disk autotune cache (TRITON_CACHE_AUTOTUNING) is switched on for the engine unless the
user set the variable, so the next start on the same machine and Triton cache reads the results
back instead of benchmarking (`enable_autotune_disk_cache`); the choices it cannot keep (configs
with pre-launch hooks: the GEMMs) go to records of their own (`tuning_records.py`). CUDA only; the
CPU interpreter has one config per kernel and nothing to tune.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import time
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from triton.runtime.autotuner import Autotuner

from sits.kernels.launch_utils import cdiv, is_interpreter, num_sms
from sits.kernels.small_m_table import m_bucket
from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.engine.tuning_plan import DecodeShape, KernelLimits, PrefillShape, TuningPlan, tuning_plan
from sits.runtime.engine.tuning_records import load_choices, save_choices
from sits.runtime.models.small_m_linear import DecodeLinear

if TYPE_CHECKING:
    from sits.runtime.config import SchedulerConfig
    from sits.runtime.engine.runner import ModelRunner

logger = logging.getLogger(__name__)

AUTOTUNE_CACHE_ENV = "TRITON_CACHE_AUTOTUNING"
TUNED_BACKENDS = ("triton",)  # attention back ends whose kernels autotune
QUANTIZED_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.int8)
_TRUE = ("1", "true", "yes", "on", "y")


@dataclass(frozen=True)
class WarmupReport:
    """What the pre-tune ran: launches (shapes), wall time in seconds, and whether the results
    persist on disk for the next start."""

    shapes: int
    seconds: float
    disk_cache: bool


def kernel_autotuners() -> list[Autotuner]:
    """The autotuners of every `sits.kernels` module (imported here if not yet), each once.

    A module that cannot be imported here (a kernel for another Triton) is left out: nothing can
    launch it either.
    """
    import sits.kernels

    tuners: dict[int, Autotuner] = {}
    for info in pkgutil.iter_modules(sits.kernels.__path__):
        try:
            module = importlib.import_module(f"sits.kernels.{info.name}")
        except ImportError as error:
            logger.debug("sits.kernels.%s not imported (%s): none of its kernels to tune", info.name, error)
            continue
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                tuners[id(value)] = value
    return list(tuners.values())


def autotune_disk_cache_wanted(environ: MutableMapping[str, str]) -> bool:
    """True unless the user switched Triton's on-disk autotune cache off (TRITON_CACHE_AUTOTUNING)."""
    value = environ.get(AUTOTUNE_CACHE_ENV)
    return value is None or value.strip().lower() in _TRUE


def enable_autotune_disk_cache(environ: MutableMapping[str, str] | None = None) -> bool:
    """Keep autotune results on disk (Triton's cache directory) unless the user said otherwise.

    Sets TRITON_CACHE_AUTOTUNING=1 when unset (autotuners defined later and child processes read
    it) and turns the cache on for the autotuners already defined, which read it when created.
    Returns whether results persist (never under the interpreter, which does not tune).
    """
    environ = os.environ if environ is None else environ
    if not autotune_disk_cache_wanted(environ) or is_interpreter():
        return False
    environ.setdefault(AUTOTUNE_CACHE_ENV, "1")
    for tuner in kernel_autotuners():
        tuner.cache_results = True
    return True


def kernel_limits(runner: ModelRunner, scheduler: SchedulerConfig, max_model_len: int) -> KernelLimits:
    """The limits of this engine's steps, and the cache geometry of this runner (its rank's heads)."""
    return KernelLimits(
        max_num_batched_tokens=scheduler.max_num_batched_tokens, max_num_seqs=scheduler.max_num_seqs,
        max_model_len=max_model_len, block_size=runner.block_size, num_kv_heads=runner.kv_shape.num_kv_heads,
        num_sms=num_sms(runner.device), cache_tokens=runner.num_blocks * runner.block_size,
    )  # fmt: skip


@torch.inference_mode()
def pretune_kernels(runner: ModelRunner, dtype: torch.dtype, scheduler: SchedulerConfig,
                    max_model_len: int) -> WarmupReport | None:
    """Tune every kernel key the engine can reach (after allocate_kv_cache, before graph capture).

    Args:
        runner: the model runner, its KV cache allocated (only read: no launch writes a slot).
        dtype: the model's activation dtype (queries, GEMM inputs).
        scheduler: the step limits (max_num_batched_tokens, max_num_seqs).
        max_model_len: the longest context, in tokens.
    Returns:
        The report (also logged in one line), or None where nothing autotunes (no CUDA, the interpreter).
    """
    if runner.device.type != "cuda" or is_interpreter() or not runner.kv_caches:
        return None
    disk_cache = enable_autotune_disk_cache()
    start = time.perf_counter()
    tuners, gpu = kernel_autotuners(), torch.cuda.get_device_name(runner.device)
    if disk_cache:  # choices Triton's disk cache cannot keep (configs with pre-launch hooks)
        load_choices(tuners, gpu)
    plan = tuning_plan(kernel_limits(runner, scheduler, max_model_len))
    shapes = run_attention_plan(runner, dtype, plan) + run_gemm_plan(runner.model, dtype, plan.gemm_rows)
    shapes += run_small_m_plan(runner.model, plan.small_m_rows)
    torch.cuda.synchronize(runner.device)
    if disk_cache:
        save_choices(tuners, gpu)
    report = WarmupReport(shapes, time.perf_counter() - start, disk_cache)
    where = ("cached on disk for the next start" if disk_cache
             else f"{AUTOTUNE_CACHE_ENV} is off: tuned again at every start")
    logger.info("kernels tuned for %d shapes in %.1f s (%s)", report.shapes, report.seconds, where)
    return report


def run_attention_plan(runner: ModelRunner, dtype: torch.dtype, plan: TuningPlan) -> int:
    """Launch the attention back end over every prefill and decode shape of `plan`; returns the count.

    Nothing runs (0) for back ends whose kernels do not autotune (the torch reference).
    """
    backend = getattr(runner.model, "backend", None)
    if backend is None or getattr(backend, "name", None) not in TUNED_BACKENDS:
        return 0
    k_cache, v_cache = runner.kv_caches[0]
    config = runner.model.config
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_q_heads = num_kv_heads * (config.num_attention_heads // config.num_key_value_heads)
    scales = {}
    if k_cache.dtype == torch.float8_e4m3fn:  # an fp8 cache is read with per-KV-head scales
        ones = torch.ones(num_kv_heads, dtype=torch.float32, device=runner.device)
        scales = {"k_scale": ones, "v_scale": ones}
    rope_table = getattr(runner.model, "cos_sin_cache", None)
    batches: list[PrefillShape | DecodeShape] = [*plan.prefill, *plan.decode]
    for shape in batches:
        metadata = dummy_metadata(shape, runner.block_size, runner.num_blocks, runner.device)
        q = torch.randn(metadata.num_tokens, num_q_heads, head_dim, dtype=dtype, device=runner.device)
        kv = torch.zeros(metadata.num_tokens, num_kv_heads, head_dim, dtype=dtype, device=runner.device)
        if isinstance(shape, DecodeShape) and rope_table is not None:  # as decode steps call it: RoPE may fuse in
            positions = torch.zeros(metadata.num_tokens, dtype=torch.int64, device=runner.device)
            backend.rope_write_attend(q, kv, kv, positions, rope_table, k_cache, v_cache, metadata, head_dim**-0.5,
                                      **scales)
        else:
            backend.forward(q, kv, kv, k_cache, v_cache, metadata, head_dim**-0.5, **scales)
    return len(batches)


def dummy_metadata(shape: PrefillShape | DecodeShape, block_size: int, num_blocks: int,
                   device: torch.device) -> AttentionMetadata:
    """A step of only prefills or only decodes with `shape`'s lengths; every slot is -1 (no cache
    write) and the block tables walk the cache's blocks in order, wrapping around."""
    if isinstance(shape, PrefillShape):
        num_seqs, query_len, context_len, prefills = shape.num_seqs, shape.query_len, shape.context_len, shape.num_seqs
    else:
        num_seqs, query_len, context_len, prefills = shape.num_seqs, 1, shape.max_context, 0
    width = cdiv(context_len, block_size)
    tables = torch.arange(num_seqs * width, device=device).remainder(num_blocks).to(torch.int32)
    num_tokens = num_seqs * query_len
    return AttentionMetadata(
        num_prefills=prefills, num_prefill_tokens=num_tokens if prefills else 0, num_decodes=num_seqs - prefills,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((num_seqs,), context_len, dtype=torch.int32, device=device),
        block_tables=tables.view(num_seqs, width), max_query_len=query_len, max_seq_len=context_len,
        seq_lens_list=[context_len] * num_seqs, query_lens_list=[query_len] * num_seqs,
    )  # fmt: skip


def quantized_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """One layer per distinct quantized GEMM: layers with an fp8 / int8 `weight` and `in_features`,
    deduplicated by their class, shape, weight dtype and group size (every decoder layer repeats them)."""
    layers: dict[tuple, torch.nn.Module] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype not in QUANTIZED_WEIGHT_DTYPES:
            continue
        if not hasattr(module, "in_features"):
            continue
        signature = (type(module), tuple(weight.shape), weight.dtype, getattr(module, "group_size", None))
        layers.setdefault(signature, module)
    return list(layers.values())


def run_gemm_plan(model: torch.nn.Module, dtype: torch.dtype, rows: Iterable[int]) -> int:
    """Run each distinct quantized layer of `model` on every row count; returns the launches."""
    rows = sorted(rows)
    if not rows:
        return 0
    launches = 0
    for layer in quantized_layers(model):
        device = layer.weight.device  # a tensor: quantized_layers checked it
        inputs = torch.randn(rows[-1], int(layer.in_features), dtype=dtype, device=device)  # type: ignore[arg-type]
        for count in rows:
            layer(inputs[:count])
            launches += 1
    return launches


def _small_m_buckets(module: DecodeLinear) -> tuple[frozenset[int], ...]:
    return (module.direct_buckets, module.splitk_buckets, module.silu_mul_buckets, module.norm_buckets,
            module.norm_silu_mul_buckets, module.fold_buckets)


def small_m_layers(model: torch.nn.Module) -> list[DecodeLinear]:
    """One DecodeLinear per distinct small-M launch set: layers whose table gave them direct (or fused
    SiLU·mul, or fused norm) buckets, deduplicated by shape, dtype and buckets (every decoder layer repeats
    them)."""
    layers: dict[tuple, DecodeLinear] = {}
    for module in model.modules():
        if isinstance(module, DecodeLinear) and any(_small_m_buckets(module)):
            signature = (tuple(module.weight.shape), module.weight.dtype, module.fold_role, *_small_m_buckets(module))
            layers.setdefault(signature, module)
    return list(layers.values())


def _run_norm_fused(layer: DecodeLinear, inputs: torch.Tensor, stream_dtype: torch.dtype) -> int:
    """The fused norm's launches of one bucket (inputs: its rows): with a residual stream, and for the
    plain variant (qkv_proj: the first layer's input norm starts the stream) without; returns the launches."""
    weight = torch.ones(layer.in_features, dtype=inputs.dtype, device=inputs.device)
    residual = torch.zeros(inputs.shape, dtype=stream_dtype, device=inputs.device)
    launches = 0
    for silu_mul, buckets in ((False, layer.norm_buckets), (True, layer.norm_silu_mul_buckets)):
        if m_bucket(inputs.shape[0]) in buckets:
            layer.norm_linear(inputs, residual, weight, 1e-5, None, silu_mul)
            launches += 1
            if not silu_mul:
                layer.norm_linear(inputs, None, weight, 1e-5, stream_dtype)
                launches += 1
    return launches


def run_small_m_plan(model: torch.nn.Module, rows: Iterable[int]) -> int:
    """Run each distinct small-M layer of `model` (`small_m_layers`) on every row count whose bucket it runs
    on the direct kernel, its fused SiLU·mul on those of its SiLU·mul buckets, its fused norm (with and
    without a residual stream in the model's `residual_dtype`) on those of its norm buckets, and its folded-norm
    launch on those of its fold buckets; returns the launches. The first two take rows in the model's
    `activation_dtype` (float32 with --activation-dtype float32: the kernels' two-term launches), the others in
    the weight's; with float32 activations the fused norm is skipped, as no step runs it."""
    rows = sorted(rows)
    launches = 0
    for layer in small_m_layers(model) if rows else []:
        inputs = torch.randn(rows[-1], layer.in_features, dtype=layer.weight.dtype, device=layer.weight.device)
        activations = inputs.to(getattr(model, "activation_dtype", None) or layer.weight.dtype)
        stream_dtype = getattr(model, "residual_dtype", None) or layer.weight.dtype
        for count in rows:
            if m_bucket(count) in layer.direct_buckets:
                layer(activations[:count])
                launches += 1
            if m_bucket(count) in layer.silu_mul_buckets:
                layer.silu_mul(activations[:count])
                launches += 1
            if not getattr(model, "activation_dtype", None):  # float32 rows never fuse a norm (RMSNorm.fuses_into)
                launches += _run_norm_fused(layer, inputs[:count], stream_dtype)
            launches += _run_folded(layer, inputs[:count])
    return launches


def _run_folded(layer: DecodeLinear, inputs: torch.Tensor) -> int:
    """The folded norms' launch of one bucket (inputs: its rows) in the layer's role (norm_fold.py); returns the
    launches (0 or 1)."""
    rows = inputs.shape[0]
    if m_bucket(rows) not in layer.fold_buckets:
        return 0
    if layer.fold_role == "stream":
        layer.to_stream(inputs, torch.zeros(rows, layer.out_features, dtype=torch.float32, device=inputs.device))
        return 1
    from sits.kernels.gemm_small_m import sumsq_slots

    sumsq = torch.ones(rows, sumsq_slots(layer.in_features), dtype=torch.float32, device=inputs.device)
    if layer.fold_role == "scale_silu_mul":
        layer.scaled_silu_mul(inputs, sumsq, 1e-5)
    else:
        layer.scaled(inputs, sumsq, 1e-5)
    return 1
