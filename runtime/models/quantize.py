"""Weight quantization of a built model: its nn.Linear layers become Fp8Linear or Int8Linear.

As gpt-fast's quantize.py: the model stays plain nn.Module code, and quantization is a conversion
applied to the built (loaded) model, chosen by config (`--quantization fp8|int8`), never by a file
name.

* fp8: weights to e4m3 with one float32 scale per output channel, at load; then one of two modes
  (`--fp8-mode`, FP8_MODES):
  - w8a8: activations quantized per token at run time (one scale per row), then the scaled e4m3
    GEMM on fp8 tensor cores (fp8_quantize, then fp8_gemm_on): Triton or torch._scaled_mm, precise
    or fast sums, per M bucket from the measured table of sits.kernels.fp8_accum.
  - weight-only: activations stay in the model dtype; each weight tile is converted to it inside
    the GEMM's load (fp8_weight_only_gemm). The path of GPUs without fp8 tensor cores (SM < 8.9,
    e.g. the A100), which `auto` picks there; forced elsewhere to test and measure it.
  On CUDA these are the Triton kernels of `sits.kernels`; elsewhere their plain-PyTorch references,
  which compute the same function (CPU tests, accuracy checks).
* int8 (W8A16): weights to int8 with one scale per group of `group_size` input features;
  activations stay in the model dtype and each weight tile is dequantized inside the GEMM
  (sits.kernels.int8_gemm on CUDA, its reference elsewhere).

The output head (`lm_head`, often tied to the embedding) stays in the model dtype: it is read once
per step like any layer, but its rounding errors land directly on the logits.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import nn

from sits.kernels.fp8_accum import (
    DEFAULT_TABLE_PATH,
    SCALED_MM_BACKENDS,
    AccumTable,
    backend_at,
    load_accum_table,
)
from sits.kernels.quantization import quantize_weight_fp8_per_channel, quantize_weight_int8
from sits.kernels.reference import (
    fp8_gemm_reference,
    fp8_weight_only_gemm_reference,
    int8_weight_only_gemm_reference,
    quantize_fp8_per_token_reference,
    silu_mul_quant_fp8_reference,
)
from sits.runtime.config import FP8_MODES, ConfigError
from sits.runtime.models.table_env import table_from_env

logger = logging.getLogger(__name__)

METHODS = ("none", "fp8", "int8")
FP8_TENSOR_CORES = (8, 9)  # the first compute capability with fp8 tensor cores (Ada; Hopper is 9.0)
DEFAULT_SKIP = ("lm_head",)
INT8_GROUP_SIZES = (128, 64, 32)  # the largest that divides in_features is used


def _fp8_gemm_cuda(x_fp8, x_scale, weight, scale, out_dtype, backend):
    from sits.kernels.fp8_gemm import fp8_gemm_on

    return fp8_gemm_on(backend, x_fp8, x_scale, weight, scale, out_dtype=out_dtype)


def _fp8_gemm_reference(x_fp8, x_scale, weight, scale, out_dtype, backend):
    return fp8_gemm_reference(x_fp8, x_scale, weight, scale, out_dtype=out_dtype)  # float32 sums: every backend's


def _fp8_matmul_cuda(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, backend: str) -> torch.Tensor:
    from sits.kernels.fp8_quantize import quantize_fp8_per_token

    x_fp8, x_scale = quantize_fp8_per_token(x)
    return _fp8_gemm_cuda(x_fp8, x_scale, weight, scale, x.dtype, backend)


def _fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, backend: str) -> torch.Tensor:
    x_fp8, x_scale = quantize_fp8_per_token_reference(x)  # float32 sums: every backend's exact result
    return fp8_gemm_reference(x_fp8, x_scale, weight, scale, out_dtype=x.dtype)


def _fp8_weight_only_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, backend: str,
                            decode: str) -> torch.Tensor:
    from sits.kernels.fp8_weight_only_gemm import fp8_weight_only_gemm

    if x.dtype not in (torch.bfloat16, torch.float16):  # a float32 model: no half tensor cores to feed
        return fp8_weight_only_gemm_reference(x, weight, scale)
    return fp8_weight_only_gemm(x, weight, scale, decode)


def _fp8_weight_only_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, backend: str
                               ) -> torch.Tensor:
    return fp8_weight_only_gemm_reference(x, weight, scale)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` multiplies fp8 on tensor cores (CUDA compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_TENSOR_CORES


def resolve_fp8_mode(mode: str, device: torch.device) -> str:
    """"w8a8" or "weight-only" for `--fp8-mode` on `device`.

    auto: weight-only on a CUDA GPU without fp8 tensor cores (before SM 8.9), w8a8 elsewhere (the
    CPU runs the w8a8 reference, as before the weight-only path existed).
    Raises:
        ValueError: an unknown mode.
    """
    if mode not in FP8_MODES:
        raise ValueError(f"fp8 mode must be one of {', '.join(FP8_MODES)}, got {mode!r}")
    if mode == "auto":
        return "weight-only" if device.type == "cuda" and not has_fp8_tensor_cores(device) else "w8a8"
    return mode


def _int8_matmul_triton(x, weight, scales, group_size):
    from sits.kernels.int8_gemm import int8_weight_only_gemm

    return int8_weight_only_gemm(x, weight, scales, group_size)


def _int8_matmul_reference(x, weight, scales, group_size):
    return int8_weight_only_gemm_reference(x, weight, scales, group_size)


class Fp8Linear(nn.Module):
    """y = x Wᵀ + b with W in e4m3 [out, in] and per-channel scales [out].

    w8a8: x quantized per token, then the scaled e4m3 GEMM on the backend `accum` chose for this
    weight's shape and the call's M bucket (Triton or torch._scaled_mm, precise or fast sums; on the
    CPU, the reference); weight-only: x stays in its dtype and W is dequantized inside the GEMM's load.

    Args:
        weight: [out_features, in_features] float8_e4m3fn.
        weight_scale: [out_features] float32.
        bias: [out_features] in the model dtype, or None.
        weight_only: the weight-only mode (default: w8a8).
        accum: the GEMM backend per shape (w8a8 on CUDA); default: precise Triton everywhere.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 weight_only: bool = False, accum: AccumTable | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.reshape(-1).contiguous())
        self.register_buffer("bias", bias)
        self.weight_only = weight_only
        # (m_bucket, backend) of this weight's shape, ascending; read per call by backend_at (host only)
        self.gemm_steps = () if weight_only else (accum or AccumTable()).steps(self.out_features, self.in_features)
        if weight_only and weight.is_cuda:  # the e4m3 decoding this GPU supports, picked once
            from sits.kernels.fp8_weight_only_gemm import native_decode_supported

            decode = "native" if native_decode_supported(weight.device) else "bits"
            self._matmul = functools.partial(_fp8_weight_only_triton, decode=decode)
        elif weight_only:
            self._matmul = _fp8_weight_only_reference
        else:
            self._matmul = _fp8_matmul_cuda if weight.is_cuda else _fp8_matmul_reference
        self._gemm = _fp8_gemm_cuda if weight.is_cuda else _fp8_gemm_reference
        self.input_quantized_upstream = False  # set by fuse_fp8_norm_quant: a norm may quantize this layer's input

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_only: bool = False, accum: AccumTable | None = None) -> Fp8Linear:
        weight, scale = quantize_weight_fp8_per_channel(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, scale, bias, weight_only, accum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] → [..., out_features] in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        out = self._matmul(rows, self.weight, self.weight_scale, self.backend_for(rows.shape[0]))
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward_quantized(self, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The w8a8 product of activations an earlier kernel already quantized per token.

        Args:
            x_fp8: [M, in_features] float8_e4m3fn.
            x_scale: [M, 1] float32.
            out_dtype: the model dtype.
        Returns:
            [M, out_features] in out_dtype.
        """
        out = self._gemm(x_fp8, x_scale, self.weight, self.weight_scale, out_dtype, self.backend_for(x_fp8.shape[0]))
        return out if self.bias is None else out + self.bias

    def accepts_quantized_input(self) -> bool:
        """Whether the norm before this layer may hand it e4m3 rows and scales (`forward_quantized`) instead of x:
        w8a8, enabled by fuse_fp8_norm_quant, and no hook (which would expect forward's x). Host-side only."""
        return self.input_quantized_upstream and not self.weight_only and not (
            self._forward_hooks or self._forward_pre_hooks)

    def backend_for(self, rows: int) -> str:
        """The w8a8 GEMM backend (sits.kernels.fp8_accum.BACKENDS) of a call with `rows` tokens."""
        return backend_at(self.gemm_steps, rows)

    def extra_repr(self) -> str:
        mode = "weight-only" if self.weight_only else "w8a8"
        steps = ", ".join(f"{bucket}: {backend}" for bucket, backend in self.gemm_steps)
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per-channel, {mode}"
                + (f", GEMM backend per M bucket {{{steps}}}" if steps else ""))


def _silu_mul_quant_triton(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from sits.kernels.silu_mul import silu_mul_quant_fp8

    return silu_mul_quant_fp8(gate_up)


class Fp8SwiGLU(nn.Module):
    """A Llama MLP, down(silu(gate(x)) * up(x)), whose projections are fp8 w8a8.

    The SiLU·mul kernel quantizes its product per token in its epilogue (e4m3 values and one scale
    per row), so the down projection runs on them directly instead of reading the bf16 product back
    for its own quantization pass. Same function as the unfused MLP: the product is rounded to the
    model dtype before it is quantized, as silu_mul stores it.

    Args:
        gate_up_proj: [2F, hidden] Fp8Linear (gate rows first).
        down_proj: [hidden, F] Fp8Linear, w8a8.
    """

    def __init__(self, gate_up_proj: Fp8Linear, down_proj: Fp8Linear) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.intermediate_size = down_proj.in_features
        self._activation = _silu_mul_quant_triton if down_proj.weight.is_cuda else silu_mul_quant_fp8_reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] → [..., hidden] in x's dtype."""
        gate_up = self.gate_up_proj(x)
        product_fp8, product_scale = self._activation(gate_up.reshape(-1, gate_up.shape[-1]))
        out = self.down_proj.forward_quantized(product_fp8, product_scale, x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def forward_quantized_input(self, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype
                                ) -> torch.Tensor:
        """`forward` of an input the norm before it already quantized per token (fp8 w8a8 gate_up).

        Args:
            x_fp8: [M, hidden] float8_e4m3fn.
            x_scale: [M, 1] float32.
            out_dtype: the model dtype (forward's x's).
        Returns:
            [M, hidden] in out_dtype.
        """
        gate_up = self.gate_up_proj.forward_quantized(x_fp8, x_scale, out_dtype)
        product_fp8, product_scale = self._activation(gate_up)
        return self.down_proj.forward_quantized(product_fp8, product_scale, out_dtype)

    def accepts_quantized_input(self) -> bool:
        """Whether the norm before this MLP may hand it e4m3 rows (`forward_quantized_input`): its gate_up
        accepts them and no hook on the MLP expects forward's x. Host-side only."""
        return self.gate_up_proj.accepts_quantized_input() and not (self._forward_hooks or self._forward_pre_hooks)


def fuse_fp8_activation_quant(model: nn.Module) -> int:
    """Replace each Llama MLP whose projections are both fp8 w8a8 by an Fp8SwiGLU; returns how many.

    MLPs of another kind (tensor-parallel shards, weight-only or unconverted projections) are kept.
    """
    from sits.runtime.models.llama import LlamaMLP

    fused = 0
    for name, module in list(model.named_modules()):
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(module, LlamaMLP) and isinstance(gate_up, Fp8Linear) and isinstance(down, Fp8Linear)):
            continue
        if gate_up.weight_only or down.weight_only or gate_up.out_features != 2 * down.in_features:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Fp8SwiGLU(gate_up, down))
        fused += 1
    return fused


NORM_QUANT_ENV = "SITS_FP8_NORM_QUANT"


def fuse_fp8_norm_quant(model: nn.Module) -> int:
    """Let each decoder layer's norms quantize the input of the fp8 w8a8 projection they feed (qkv_proj; an
    Fp8SwiGLU's gate_up) in the norm's own launch; returns how many projections take quantized input.

    Not on a tensor-parallel shard (`model.tensor_parallel` over more than one rank), whose path stays as it was,
    nor with SITS_FP8_NORM_QUANT=off (to measure the unfused step in the same build). Where it applies, the layer
    decides per call (`RMSNorm.quantizes_for`: the Triton norm, not compiled).
    """
    layout = getattr(model, "tensor_parallel", None)
    if (layout is not None and layout.world_size > 1) or os.environ.get(NORM_QUANT_ENV, "").strip().lower() == "off":
        return 0
    enabled = 0
    for module in model.modules():
        attention, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        for consumer in (getattr(attention, "qkv_proj", None), getattr(mlp, "gate_up_proj", None)):
            if isinstance(consumer, Fp8Linear) and not consumer.weight_only:
                consumer.input_quantized_upstream = True
                enabled += 1
    return enabled


class Int8Linear(nn.Module):
    """y = x dequant(W)ᵀ + b with W in int8 [out, in] and one scale per group of input features.

    Args:
        weight: [out_features, in_features] int8.
        scales: [out_features, in_features // group_size] float32.
        bias: [out_features] in the model dtype, or None.
        group_size: input features per scale.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = group_size
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        self._matmul = _int8_matmul_triton if weight.is_cuda else _int8_matmul_reference

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int8Linear:
        weight, scales = quantize_weight_int8(linear.weight.detach(), group_size)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, scales, bias, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._matmul(rows, self.weight, self.scales, self.group_size)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 weight-only, group {self.group_size}")


def int8_group_size(in_features: int) -> int | None:
    """The largest supported group size dividing in_features, or None."""
    return next((g for g in INT8_GROUP_SIZES if in_features % g == 0), None)


def _convert(linear: nn.Linear, method: str, fp8_mode: str, accum: AccumTable) -> nn.Module | None:
    if method == "fp8":
        if linear.in_features % 16:
            return None  # fp8 tensor cores need K % 16 == 0
        return Fp8Linear.from_linear(linear, fp8_mode == "weight-only", accum)
    group_size = int8_group_size(linear.in_features)
    return None if group_size is None else Int8Linear.from_linear(linear, group_size)


GEMM_TABLE_ENV = "SITS_FP8_GEMM_TABLE"


def _installed_table(device_name: str) -> AccumTable:
    """The GEMM backend table for this GPU: SITS_FP8_GEMM_TABLE=off gives the default rule (precise Triton
    everywhere: to measure what the table changes), =PATH another measured table, unset the installed one."""
    return table_from_env(GEMM_TABLE_ENV, device_name, DEFAULT_TABLE_PATH, load_accum_table, AccumTable,
                          "benchmarks/bench_fp8_accum.py --table")


def _fp8_setup(targets: list[tuple[str, nn.Linear]], fp8_mode: str, accum: AccumTable | None
               ) -> tuple[str, AccumTable]:
    """The resolved fp8 mode for the layers' device, and the GEMM backend table (w8a8 on CUDA: the
    measured table of this GPU when one is installed, else the default rule; a table's
    torch._scaled_mm choices are re-chosen among the Triton figures where this PyTorch build cannot
    run rowwise-scaled torch._scaled_mm)."""
    device = targets[0][1].weight.device if targets else torch.device("cpu")
    mode = resolve_fp8_mode(fp8_mode, device)
    if mode == "w8a8" and device.type == "cuda" and not has_fp8_tensor_cores(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"--fp8-mode w8a8 needs fp8 tensor cores (SM 8.9 or later); this GPU is SM {major}.{minor}: "
                          "use --fp8-mode weight-only (or auto, which picks it)")
    if accum is None and device.type == "cuda" and mode == "w8a8":
        accum = _installed_table(torch.cuda.get_device_name(device))
    accum = accum or AccumTable()
    if mode == "w8a8" and device.type == "cuda" and accum.backends_used() & SCALED_MM_BACKENDS:
        from sits.kernels.fp8_gemm import scaled_mm_runs

        if not scaled_mm_runs(device):
            logger.warning("fp8: this PyTorch build cannot run rowwise-scaled torch._scaled_mm on %s; the shapes "
                           "the table gave it run the fastest Triton mode measured instead",
                           torch.cuda.get_device_name(device))
            accum = accum.without(SCALED_MM_BACKENDS)
    reason = f"forced by --fp8-mode {fp8_mode}" if fp8_mode != "auto" else (
        "no fp8 tensor cores" if mode == "weight-only" else "fp8 tensor cores" if device.type == "cuda"
        else "the PyTorch reference on the CPU")
    logger.info("fp8 %s (%s)%s", mode, reason, "" if mode == "weight-only" else f"; GEMM backends: {accum.describe()}")
    return mode, accum


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, skip: tuple[str, ...] = DEFAULT_SKIP, fp8_mode: str = "auto",
                   accum: AccumTable | None = None, fuse_activation_quant: bool = True) -> int:
    """Replace the model's nn.Linear layers in place; returns how many were converted.

    Args:
        model: a built model (weights loaded), on the device it will run on.
        method: "none", "fp8" or "int8".
        skip: module names (last component) kept in the model dtype.
        fp8_mode: with fp8, "auto", "w8a8" or "weight-only" (resolve_fp8_mode).
        accum: with fp8 w8a8, the GEMM backend per shape; None: the installed table of this GPU
            (sits.kernels.fp8_accum.load_accum_table), else precise Triton everywhere.
        fuse_activation_quant: with fp8 w8a8, quantize the MLP's SiLU·mul product in that kernel's
            epilogue (Fp8SwiGLU) instead of in a pass of its own before the down projection, and the
            input of qkv_proj and gate_up_proj in the epilogue of the norm before them (fuse_fp8_norm_quant).
    Raises:
        ValueError: an unknown method or fp8 mode.
    """
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "none":
        return 0
    converted, kept = 0, []
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    mode, accum = _fp8_setup(targets, fp8_mode, accum) if method == "fp8" else ("", AccumTable())
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        if child in skip:
            continue
        replacement = _convert(linear, method, mode, accum)
        if replacement is None:
            kept.append(name)
            continue
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        converted += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 weights just released
    fused = fuse_fp8_activation_quant(model) if mode == "w8a8" and fuse_activation_quant else 0
    norm_fused = fuse_fp8_norm_quant(model) if mode == "w8a8" and fuse_activation_quant else 0
    logger.info("quantization %s: %d linear layers converted%s%s%s", method, converted,
                f"; kept in the model dtype (shape unsupported): {', '.join(kept)}" if kept else "",
                f"; {fused} MLPs quantize the SiLU·mul product in its epilogue" if fused else "",
                f"; {norm_fused} projections take their input quantized by the norm before them" if norm_fused
                else "")
    return converted


def fp8_mode_of(model: nn.Module) -> str | None:
    """"w8a8" or "weight-only" for an fp8 model's linear layers; None when they are not fp8."""
    layer = next((m for m in model.modules() if isinstance(m, Fp8Linear)), None)
    return None if layer is None else "weight-only" if layer.weight_only else "w8a8"


def quantization_of(model: nn.Module) -> str:
    """"fp8", "int8" or "none": how the model's linear layers are stored."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            return "fp8"
        if isinstance(module, Int8Linear):
            return "int8"
    return "none"
