"""The fp8 (e4m3) KV cache: its dtype, the scales that give its bytes a meaning, and their calibration.

Scheme (docs/fp8-kv-cache.md): K and V are stored as float8_e4m3fn with one float32 dequantization
scale per layer and per KV head, `value = stored * scale`; a write stores `clamp(value / scale, ±448)`.
The scales are fixed for the life of the engine:
  - `static` (the default): 1.0 everywhere, what vLLM does without checkpoint scales;
  - `calibrate`: one forward of a calibration prompt at start-up over a scratch cache in the model's
    dtype, then `scale = CALIBRATION_HEADROOM * amax / 448` per layer and head.
They are set before any request runs and before CUDA graphs are captured, so every block in the
cache (and every block the host tier keeps) was written with the scales it is read with; a cached
prefix block is just bytes.

`KVCacheScales` owns them: one [num_layers, num_kv_heads] float32 tensor each for K and V, whose rows
are the views each layer's `LayerKVCache` carries to the attention back end. Calibration writes into
those tensors in place, so their storage never moves (a captured graph reads them). Under tensor
parallelism every rank holds the scales of its own KV heads (static scales only, for now).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from sits.runtime.config import CacheConfig, ConfigError

if TYPE_CHECKING:
    from sits.runtime.engine.runner import ModelRunner

logger = logging.getLogger(__name__)

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# A calibrated scale maps twice the calibration prompt's amax to 448: later prompts may go past the
# calibration's largest value, and e4m3 keeps its relative precision over the lower range anyway.
CALIBRATION_HEADROOM = 2.0
MIN_SCALE = 1e-6  # a head whose calibration values were all zero keeps a usable scale
# Text of the calibration pass: prose, a list, code and numbers, so K and V see varied tokens.
CALIBRATION_TEXT = (
    "The history of computing is a story of people who wanted answers faster than they could count. "
    "In 1843 Ada Lovelace wrote notes on the Analytical Engine; a century later, machines filled rooms. "
    "Recipe: 1. Preheat the oven to 200 C. 2. Mix 250 g of flour, 2 eggs and a pinch of salt. 3. Bake 25 min.\n"
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n"
    "Question: what is the capital of France? Answer: Paris, a city of about 2.1 million people on the Seine. "
    "Les modèles de langage prédisent le mot suivant; 東京は日本の首都です. SELECT name FROM users WHERE id = 42;"
)


class LayerKVCache(tuple):
    """One layer's cache: unpacks as the pair (k_cache, v_cache), and carries an fp8 cache's scales.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; k_scale, v_scale: [num_kv_heads]
    float32 (views of `KVCacheScales`), None for a cache in the model's dtype.
    """

    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> LayerKVCache:
        self = super().__new__(cls, (k_cache, v_cache))
        self.k_scale, self.v_scale = k_scale, v_scale
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (LayerKVCache, (self[0], self[1], self.k_scale, self.v_scale))


def scale_kwargs(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments an attention back end takes for this layer's cache: {} for a cache in the
    model's dtype (a plain pair, too), {"k_scale": ..., "v_scale": ...} for an fp8 one."""
    k_scale = getattr(kv_cache, "k_scale", None)
    if k_scale is None:
        return {}
    return {"k_scale": k_scale, "v_scale": kv_cache.v_scale}  # type: ignore[attr-defined]


class KVCacheScales:
    """The dequantization scales of an fp8 cache: k and v, each [num_layers, num_kv_heads] float32.

    Args:
        num_layers, num_kv_heads: the cache geometry (this rank's KV heads under tensor parallelism).
        device: where the cache lives.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, device: torch.device) -> None:
        self.k = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.v = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.source = "static"  # "static" (1.0) or "calibrated"

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s (k_scale, v_scale), each a [num_kv_heads] view (fixed storage)."""
        return self.k[index], self.v[index]

    def set_from_amax(self, k_amax: torch.Tensor, v_amax: torch.Tensor) -> None:
        """Calibrated scales from each layer's and head's largest |K| and |V| ([num_layers, num_kv_heads]),
        written in place."""
        for scales, amax in ((self.k, k_amax), (self.v, v_amax)):
            scales.copy_((amax.float() * (CALIBRATION_HEADROOM / FP8_E4M3_MAX)).clamp_min(MIN_SCALE))
        self.source = "calibrated"

    def describe(self) -> str:
        """A short account for the log, e.g. "calibrated per-head scales, k 0.01-0.31, v 0.002-0.04"."""
        if self.source == "static":
            return "static per-head scales 1.0"
        return (f"calibrated per-head scales, k {self.k.min().item():.3g}-{self.k.max().item():.3g}, "
                f"v {self.v.min().item():.3g}-{self.v.max().item():.3g}")


def kv_cache_torch_dtype(cache: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache is stored in: the model's for "auto", float8_e4m3fn for "fp8"."""
    return FP8_KV_DTYPE if cache.fp8 else model_dtype


def check_fp8_kv_support(backend: Any, device: torch.device, model_dtype: torch.dtype) -> None:
    """Raise ConfigError when an fp8 cache cannot run with this attention back end, device and dtype.

    The back end must declare `fp8_kv_cache`; the Triton kernels convert e4m3 in hardware, which
    NVIDIA GPUs have from compute capability 8.9 (Ada, Hopper) on.
    """
    name = getattr(backend, "name", "?")
    if not getattr(backend, "fp8_kv_cache", False):
        raise ConfigError(f"--kv-cache-dtype fp8: the {name} attention back end does not read an fp8 cache; "
                          "use --attention-backend triton or torch")
    if model_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"--kv-cache-dtype fp8 needs a float32, float16 or bfloat16 model, not {model_dtype}")
    if name == "triton" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(
                f"--kv-cache-dtype fp8 with the triton back end needs a GPU with fp8 conversions (compute "
                f"capability 8.9 or later: L4, L40, H100, H200); this one is {capability[0]}.{capability[1]}. "
                "Use --kv-cache-dtype auto")


def calibration_token_ids(tokenizer: Any, vocab_size: int, max_tokens: int) -> list[int]:
    """The calibration prompt's token ids: CALIBRATION_TEXT through the tokenizer, or (a model without
    one) a fixed spread over the vocabulary; at most `max_tokens`."""
    ids: list[int] = []
    encode = getattr(tokenizer, "encode", None)
    if encode is not None:
        try:
            ids = [int(token) for token in encode(CALIBRATION_TEXT)]
        except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot take prose (token-id text)
            logger.debug("calibration text not tokenized (%s); using spread token ids", exc)
            ids = []
        ids = [token for token in ids if 0 <= token < vocab_size]
    if not ids:
        ids = [(index * 7919 + 13) % vocab_size for index in range(256)]
    return ids[:max_tokens]


@torch.inference_mode()
def calibrate_kv_scales(runner: ModelRunner, token_ids: list[int]) -> None:
    """Set the runner's fp8 scales from one forward of `token_ids` over a scratch cache in the model's
    dtype: per layer and KV head, the largest |K| (rotated) and |V| the prompt wrote.

    Runs before CUDA graphs are captured and before any request; the scratch cache is freed after.
    """
    from sits.runtime.engine.model_input import build_model_input
    from sits.runtime.engine.request import SamplingParams
    from sits.runtime.engine.scheduler_output import ScheduledSequence
    from sits.runtime.engine.sequence import Sequence

    scales = runner.kv_scales
    if scales is None:
        raise RuntimeError("calibrating needs an fp8 cache (use_kv_cache_dtype first)")
    block_size = runner.block_size
    blocks = list(range(-(-len(token_ids) // block_size)))
    seq = Sequence("kv-calibration", "calibration", 0, list(token_ids), SamplingParams(max_tokens=1), 1, 0.0)
    scheduled = [ScheduledSequence(seq, list(token_ids), 0, blocks, samples=False)]
    caches = runner.new_caches(len(blocks), runner.dtype)
    model_input = build_model_input(scheduled, block_size, runner.device)
    runner.model(model_input.input_ids, model_input.positions, caches, model_input.metadata)
    # Unwritten slots hold zeros, which never raise an amax.
    k_amax = torch.stack([k.float().abs().amax(dim=(0, 1, 3)) for k, _ in caches])
    v_amax = torch.stack([v.float().abs().amax(dim=(0, 1, 3)) for _, v in caches])
    scales.set_from_amax(k_amax, v_amax)
    logger.info("KV cache scales calibrated on %d tokens: %s", len(token_ids), scales.describe())


def log_kv_cache(runner: ModelRunner, num_blocks: int) -> None:
    """The start-up line of an fp8 cache: its format, scales and the blocks it gains over the model dtype."""
    scales = runner.kv_scales
    if scales is None:
        return
    block_size = runner.block_size
    model_dtype = str(runner.dtype).removeprefix("torch.")
    gain = runner.dtype.itemsize // FP8_KV_DTYPE.itemsize
    gib = num_blocks * runner.kv_shape.bytes_per_block(block_size) / (1 << 30)
    logger.info("KV cache: fp8 e4m3 (%s), %dx the blocks of %s: %d blocks x %d tokens = %d tokens (%.2f GiB)",
                scales.describe(), gain, model_dtype, num_blocks, block_size, num_blocks * block_size, gib)


def configure_kv_cache_dtype(runner: ModelRunner, cache: CacheConfig, backend: Any) -> None:
    """Set the runner's cache dtype from --kv-cache-dtype, after checking the back end and device can
    run it; before the cache is sized (an fp8 block takes half the bytes of a 16-bit one)."""
    if cache.fp8:
        check_fp8_kv_support(backend, runner.device, runner.dtype)
    runner.use_kv_cache_dtype(kv_cache_torch_dtype(cache, runner.dtype))


def prepare_kv_cache_scales(runner: ModelRunner, cache: CacheConfig, tokenizer: Any, vocab_size: int,
                            max_model_len: int) -> None:
    """After allocation, before CUDA graphs: calibrate an fp8 cache's scales when asked, and log it."""
    if runner.kv_scales is None:
        return
    if cache.kv_cache_scales == "calibrate":
        calibrate_kv_scales(runner, calibration_token_ids(tokenizer, vocab_size, max_model_len))
    log_kv_cache(runner, runner.num_blocks)
