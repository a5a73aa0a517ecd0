"""Decode-batch projections on the small-M direct GEMM where a measured table says it beats cuBLAS.

`DecodeLinear` is the nn.Linear of the Llama projections (qkv_proj, o_proj, gate_up_proj, down_proj).
Until `install_small_m_gemm` gives it M buckets it is nn.Linear exactly (F.linear, cuBLAS on CUDA); a float32
input beside a half-precision weight (--activation-dtype float32) runs `mixed_linear`.
Installed, a call whose row count M (1 to 64) falls in one of its buckets runs
sits.kernels.gemm_small_m.small_m_gemm instead (or, at its `splitk_buckets`, the split-K kernel
sits.kernels.gemm_small_m_splitk.small_m_gemm_splitk, with the layer's own zeroed counters; at buckets where
the table pinned a config, that config without autotuning). A float32 input runs them too: the kernels take
each of its tiles as two terms of the weight's dtype, one launch and one pass over the weight where
`mixed_linear` makes three launches, autotuned (the pinned configs are for half-precision inputs). A gate_up
projection (`gated`: gate rows first, then up, no bias) whose SiLU·mul bucket holds M computes silu(gate) * up
in the same launch
(`small_m_gemm_silu_mul`, called by LlamaMLP). At the smallest batches the decoder norm that feeds a
projection may run in the same launch too (`norm_buckets`: qkv_proj after input_layernorm;
`norm_silu_mul_buckets`: gate_up_proj + SiLU·mul after post_attention_layernorm; sits.kernels.gemm_small_m_norm,
called by LlamaDecoderLayer). Where the decoder norms are folded into the projections (norm_fold.py,
`fold_buckets`), the model calls `to_stream` (o_proj, down_proj), `scaled` (qkv_proj) and `scaled_silu_mul`
(gate_up_proj) instead at those buckets. The choice is made on the host from the row count alone, so each
CUDA-graph batch size captures one fixed path.

Where the buckets come from (`enable_small_m_gemm`, at engine start-up, CUDA only): the committed table
kernels/small_m_gemm_table.json (sits.kernels.small_m_table, written by benchmarks/bench_gemm_small_m.py)
when it was measured on a GPU of this name; SITS_SMALL_M_GEMM=off keeps cuBLAS everywhere, =PATH reads
another table. A shape or bucket the table does not hold runs cuBLAS. Not installed on tensor-parallel
shards nor with --compile, whose paths stay as they were; quantized layers (Fp8Linear, Int8Linear) replace
DecodeLinear and are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sits.kernels.reference import (
    small_m_gemm_reference,
    small_m_gemm_rstd_reference,
    small_m_gemm_silu_mul_reference,
    small_m_gemm_silu_mul_rstd_reference,
    small_m_gemm_to_stream_reference,
    small_m_norm_gemm_reference,
    small_m_norm_gemm_silu_mul_reference,
)
from sits.kernels.small_m_table import (
    DEFAULT_TABLE_PATH,
    MAX_M,
    NORM_MAX_M,
    SmallMTable,
    load_small_m_table,
    m_bucket,
)
from sits.runtime.models.mixed_linear import mixed_linear
from sits.runtime.models.table_env import table_from_env

logger = logging.getLogger(__name__)

SMALL_M_ENV = "SITS_SMALL_M_GEMM"
HALF_DTYPES = (torch.bfloat16, torch.float16)

Gemm = Callable[..., torch.Tensor]  # (x, w, config=None) -> out; config: a pinned launch config
SplitKGemm = Callable[..., torch.Tensor]  # (x, w, counters, config=None) -> out
# (x, residual or None, norm weight, eps, w, stream dtype) -> (out, new stream): gemm_small_m_norm's functions
NormGemm = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class DecodeLinear(nn.Linear):
    """nn.Linear whose decode batches may run the direct small-M GEMM (see the module doc).

    Args:
        in_features, out_features, bias, device, dtype: as nn.Linear.
        gated: the rows are [gate; up] halves of a SwiGLU MLP (LlamaMLP's gate_up_proj), so the
            SiLU·mul can be fused into the GEMM.
    Attributes:
        direct_buckets: M buckets (powers of two <= 64) that run a Triton kernel; empty: F.linear always.
        splitk_buckets: those of direct_buckets that run the split-K kernel instead of the direct one.
        splitk_counters: the split-K kernel's int32 counters on the weight's device (zero between launches;
            set by `install_small_m_gemm` where splitk_buckets is not empty, else None).
        pinned: M bucket -> the launch config the table pinned for this layer's plain GEMM there (direct or
            split-K, whichever won); a bucket without one autotunes.
        silu_pinned: the same for the fused gate_up + SiLU·mul.
        silu_mul_buckets: M buckets whose gate_up + SiLU·mul run as one launch (gated layers only).
        norm_buckets: M buckets (<= 8) whose preceding decoder norm and this GEMM run as one launch
            (`norm_linear`; no bias).
        norm_silu_mul_buckets: the same with the SiLU·mul fused as well (`norm_silu_mul`; gated layers).
        fold_buckets: M buckets at which the model runs this layer with the decoder norms folded
            (runtime/models/norm_fold.py); fold_role says how: "stream" (o_proj, down_proj: `to_stream`),
            "scale" (qkv_proj: `scaled`), "scale_silu_mul" (gate_up_proj: `scaled_silu_mul`).
        fold_pinned: M bucket -> the config a "scale" layer's folded launch pins where the table pinned none
            for its plain GEMM there (the nearest bucket's direct config).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gated: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.gated = gated
        self.direct_buckets: frozenset[int] = frozenset()
        self.splitk_buckets: frozenset[int] = frozenset()
        self.splitk_counters: torch.Tensor | None = None
        self.pinned: dict[int, dict[str, int]] = {}
        self.silu_pinned: dict[int, dict[str, int]] = {}
        self.silu_mul_buckets: frozenset[int] = frozenset()
        self.norm_buckets: frozenset[int] = frozenset()
        self.norm_silu_mul_buckets: frozenset[int] = frozenset()
        self._gemm: Gemm = _gemm_reference
        self._gemm_splitk: SplitKGemm = _splitk_reference
        self._gemm_silu_mul: Gemm = _silu_mul_reference
        self._norm_gemm: NormGemm = small_m_norm_gemm_reference
        self._norm_gemm_silu_mul: NormGemm = small_m_norm_gemm_silu_mul_reference
        self._fold_kernels: FoldKernels = FOLD_REFERENCES
        self.fold_buckets: frozenset[int] = frozenset()
        self.fold_role = ""
        self.fold_pinned: dict[int, dict[str, int]] = {}

    def _direct_rows(self, x: torch.Tensor, buckets: frozenset[int]) -> int:
        """x's row count when it runs the direct kernel at `buckets`, else 0 (host-side: shapes and dtypes). x is
        in the weight's dtype, or float32 (--activation-dtype float32: the kernels take its two terms)."""
        if x.shape[-1] != self.in_features or x.stride(-1) != 1 or x.dtype not in (self.weight.dtype, torch.float32):
            return 0
        rows = x.numel() // self.in_features if self.in_features else 0
        return rows if 0 < rows <= MAX_M and m_bucket(rows) in buckets else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features] in x's dtype (float32 x beside a half-precision weight, the
        projections of --activation-dtype float32: the direct kernels at their buckets, else `mixed_linear`)."""
        rows = self._direct_rows(x, self.direct_buckets) if self.direct_buckets else 0
        if not rows:  # uninstalled (the usual case): one attribute test on top of nn.Linear
            if x.dtype != self.weight.dtype:
                return mixed_linear(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        bucket = m_bucket(rows)
        pinned = self._config_for(self.pinned, bucket, x)
        if self.splitk_counters is not None and bucket in self.splitk_buckets:
            out = self._gemm_splitk(flat, self.weight, self.splitk_counters, config=pinned)
        else:
            out = self._gemm(flat, self.weight, config=pinned)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _config_for(self, configs: dict[int, dict[str, int]], bucket: int, x: torch.Tensor) -> dict[str, int] | None:
        """The table's pinned config at `bucket` for a call on x: none for a float32 x (the table timed half-precision
        activations; a float32 one's tiles take more shared memory, so its launches autotune)."""
        return None if x.dtype == torch.float32 else configs.get(bucket)

    def fuses_silu_mul(self, x: torch.Tensor) -> bool:
        """Whether `silu_mul(x)` serves this call: a SiLU·mul bucket holds x's rows and no hook (a LoRA
        delta) needs the gate_up output itself."""
        if not self.silu_mul_buckets or self._forward_hooks or self._forward_pre_hooks:
            return False
        return bool(self._direct_rows(x, self.silu_mul_buckets))

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x [..., in_features] -> [..., out_features / 2], one launch (see fuses_silu_mul)."""
        rows = x.numel() // self.in_features
        out = self._gemm_silu_mul(x.reshape(rows, self.in_features), self.weight,
                                  config=self._config_for(self.silu_pinned, m_bucket(rows), x))
        return out.reshape(*x.shape[:-1], self.out_features // 2)

    def fuses_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, silu_mul: bool = False) -> bool:
        """Whether `norm_linear(x, ...)` (silu_mul: `norm_silu_mul`) serves this call: its bucket holds x's rows
        (x [rows, in_features], contiguous, in the weight's dtype, as the norm weight), and no hook (a LoRA
        delta) needs the plain output. The caller checks that the norm is the Triton one."""
        buckets = self.norm_silu_mul_buckets if silu_mul else self.norm_buckets
        if not buckets or self._forward_hooks or self._forward_pre_hooks:
            return False
        if x.dim() != 2 or not x.is_contiguous() or not x.dtype == norm_weight.dtype == self.weight.dtype:
            return False
        return bool(self._direct_rows(x, buckets))

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    stream_dtype: torch.dtype | None, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder norm of the stream and this projection in one launch (see `fuses_norm`): x [M, in] the
        previous sublayer's output, residual [M, in] the stream (None: x starts it, in stream_dtype) ->
        (out [M, out_features] (silu_mul: silu(gate) * up, [M, out_features / 2]), the new stream). The
        stream passed is left as it was: the new one is another tensor."""
        fused = self._norm_gemm_silu_mul if silu_mul else self._norm_gemm
        return fused(x, residual, norm_weight, eps, self.weight, stream_dtype=stream_dtype)

    def scaled(self, x: torch.Tensor, sumsq: torch.Tensor, eps: float) -> torch.Tensor:
        """The folded decoder norm and this projection (`fold_role` "scale"): x [M, in] the stream rounded to the
        weight's dtype, sumsq [M, cdiv(in, 32)] its sums of squares (`to_stream`) -> x @ W^T with each row
        scaled by 1 / rms, [M, out_features], on the direct kernel (W holds the norm weight)."""
        bucket = m_bucket(x.shape[0])
        config = self.fold_pinned.get(bucket) or (None if bucket in self.splitk_buckets else self.pinned.get(bucket))
        out = self._fold_kernels.scaled(x, self.weight, config=config, sumsq=sumsq, eps=eps)
        return out if self.bias is None else out + self.bias

    def scaled_silu_mul(self, x: torch.Tensor, sumsq: torch.Tensor, eps: float) -> torch.Tensor:
        """`scaled` with the SiLU·mul (`fold_role` "scale_silu_mul", a gated layer): [M, out_features / 2]."""
        return self._fold_kernels.scaled_silu_mul(x, self.weight, config=self.silu_pinned.get(m_bucket(x.shape[0])),
                                                  sumsq=sumsq, eps=eps)

    def to_stream(self, x: torch.Tensor, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """stream [M, out] float32 += x [M, in] @ W^T in place (`fold_role` "stream") -> (the new stream rounded to
        the weight's dtype [M, out], its sums of squares [M, cdiv(out, 32)] float32): the split-K kernel at its
        buckets, else the direct one."""
        bucket = m_bucket(x.shape[0])
        if self.splitk_counters is not None and bucket in self.splitk_buckets:
            return self._fold_kernels.splitk_to_stream(x, self.weight, self.splitk_counters, stream,
                                                       config=self.pinned.get(bucket))
        return self._fold_kernels.to_stream(x, self.weight, stream, config=self.pinned.get(bucket))

    def extra_repr(self) -> str:
        extra = f", direct GEMM at M buckets {sorted(self.direct_buckets)}" if self.direct_buckets else ""
        if self.splitk_buckets:
            extra += f" (split-K at {sorted(self.splitk_buckets)})"
        if self.pinned or self.silu_pinned:
            extra += f", pinned configs at M buckets {sorted(set(self.pinned) | set(self.silu_pinned))}"
        if self.silu_mul_buckets:
            extra += f", SiLU·mul fused at M buckets {sorted(self.silu_mul_buckets)}"
        if self.norm_buckets or self.norm_silu_mul_buckets:
            extra += f", norm fused at M buckets {sorted(self.norm_buckets | self.norm_silu_mul_buckets)}"
        if self.fold_buckets:
            extra += f", folded norm ({self.fold_role}) at M buckets {sorted(self.fold_buckets)}"
        return super().extra_repr() + extra


def _gemm_reference(x: torch.Tensor, w: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    """The direct GEMM's reference (a pinned config is the kernel's only)."""
    return small_m_gemm_reference(x, w)


def _silu_mul_reference(x: torch.Tensor, w: torch.Tensor, config: dict[str, int] | None = None) -> torch.Tensor:
    return small_m_gemm_silu_mul_reference(x, w)


def _splitk_reference(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor,
                      config: dict[str, int] | None = None) -> torch.Tensor:
    """The split-K GEMM's reference (the counters and a pinned config are the kernel's only)."""
    return small_m_gemm_reference(x, w)


def _rstd_reference(x, w, config=None, sumsq=None, eps=0.0):
    return small_m_gemm_rstd_reference(x, w, sumsq, eps)


def _silu_rstd_reference(x, w, config=None, sumsq=None, eps=0.0):
    return small_m_gemm_silu_mul_rstd_reference(x, w, sumsq, eps)


def _to_stream_reference(x, w, stream, config=None):
    return small_m_gemm_to_stream_reference(x, w, stream)


def _splitk_to_stream_reference(x, w, counters, stream, config=None):
    return small_m_gemm_to_stream_reference(x, w, stream)


class FoldKernels(NamedTuple):
    """The folded norms' launches (norm_fold.py): the row-scaled GEMM (x, w, config=, sumsq=, eps=), the same with
    the SiLU·mul, the stream-feeding GEMM (x, w, stream, config=) -> (out, sumsq) and its split-K form
    (x, w, counters, stream, config=)."""

    scaled: Callable[..., torch.Tensor]
    scaled_silu_mul: Callable[..., torch.Tensor]
    to_stream: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    splitk_to_stream: Callable[..., tuple[torch.Tensor, torch.Tensor]]


FOLD_REFERENCES = FoldKernels(_rstd_reference, _silu_rstd_reference, _to_stream_reference, _splitk_to_stream_reference)


def fold_kernels(device: torch.device) -> FoldKernels:
    """The folded norms' Triton launches on CUDA or under Triton's interpreter, else FOLD_REFERENCES."""
    from sits.kernels.launch_utils import is_interpreter

    if device.type == "cuda" or is_interpreter():
        from sits.kernels.gemm_small_m import small_m_gemm, small_m_gemm_silu_mul, small_m_gemm_to_stream
        from sits.kernels.gemm_small_m_splitk import small_m_gemm_splitk_to_stream

        return FoldKernels(small_m_gemm, small_m_gemm_silu_mul, small_m_gemm_to_stream, small_m_gemm_splitk_to_stream)
    return FOLD_REFERENCES


def _splitk_kernel(device: torch.device) -> SplitKGemm:
    """small_m_gemm_splitk on CUDA or under Triton's interpreter, else its reference."""
    from sits.kernels.launch_utils import is_interpreter

    if device.type == "cuda" or is_interpreter():
        from sits.kernels.gemm_small_m_splitk import small_m_gemm_splitk

        return small_m_gemm_splitk
    return _splitk_reference


def _install_splitk(module: DecodeLinear, table: SmallMTable) -> None:
    """The module's split-K buckets and, where it has some, its zeroed counters and the kernel."""
    module.splitk_buckets = table.splitk_buckets(module.out_features, module.in_features) & module.direct_buckets
    module.splitk_counters = None
    if module.splitk_buckets:
        from sits.kernels.gemm_small_m_splitk import counters_needed

        module.splitk_counters = torch.zeros(counters_needed(module.out_features), dtype=torch.int32,
                                             device=module.weight.device)
        module._gemm_splitk = _splitk_kernel(module.weight.device)


def _kernels(device: torch.device) -> tuple[Gemm, Gemm, NormGemm, NormGemm]:
    """The Triton kernels on CUDA (or under Triton's interpreter, for CPU tests), else their references:
    plain, SiLU·mul, norm + plain, norm + SiLU·mul."""
    from sits.kernels.launch_utils import is_interpreter

    if device.type == "cuda" or is_interpreter():
        from sits.kernels.gemm_small_m import small_m_gemm, small_m_gemm_silu_mul
        from sits.kernels.gemm_small_m_norm import small_m_norm_gemm, small_m_norm_gemm_silu_mul

        return small_m_gemm, small_m_gemm_silu_mul, small_m_norm_gemm, small_m_norm_gemm_silu_mul
    return _gemm_reference, _silu_mul_reference, small_m_norm_gemm_reference, small_m_norm_gemm_silu_mul_reference


def _norm_buckets(table: SmallMTable, op: str, module: DecodeLinear) -> frozenset[int]:
    """The table's buckets of a norm op for `module` (none past NORM_MAX_M, none with a bias)."""
    if module.bias is not None:
        return frozenset()
    return frozenset(b for b in table.direct_buckets(op, module.out_features, module.in_features) if b <= NORM_MAX_M)


def install_small_m_gemm(model: nn.Module, table: SmallMTable) -> int:
    """Give every half-precision DecodeLinear of `model` its buckets from `table`; returns how many layers
    run the direct kernel at some bucket (plain or fused, the norm's fusion included). Layers of other dtypes
    keep F.linear."""
    installed = 0
    for module in model.modules():
        if not isinstance(module, DecodeLinear) or module.weight.dtype not in HALF_DTYPES:
            continue
        n, k = module.out_features, module.in_features
        module.direct_buckets = table.direct_buckets("linear", n, k)
        _install_splitk(module, table)
        fusable = module.gated and module.bias is None and n % 2 == 0
        module.silu_mul_buckets = table.direct_buckets("silu_mul", n, k) if fusable else frozenset()
        module.pinned = table.pinned_configs("linear", n, k)
        module.silu_pinned = table.pinned_configs("silu_mul", n, k) if fusable else {}
        module.norm_buckets = _norm_buckets(table, "norm_linear", module) if not module.gated else frozenset()
        module.norm_silu_mul_buckets = _norm_buckets(table, "norm_silu_mul", module) if fusable else frozenset()
        module._gemm, module._gemm_silu_mul, module._norm_gemm, module._norm_gemm_silu_mul = _kernels(
            module.weight.device)
        installed += bool(module.direct_buckets or module.silu_mul_buckets or module.norm_buckets
                          or module.norm_silu_mul_buckets)
    return installed


def installed_table(device_name: str) -> SmallMTable:
    """The small-M table for this GPU: SITS_SMALL_M_GEMM=off an empty one (cuBLAS everywhere), =PATH that
    table, unset the committed one (each applies only where its device matches `device_name`).

    Raises:
        ConfigError: the path names no file, or the file is not a valid table.
    """
    return table_from_env(SMALL_M_ENV, device_name, DEFAULT_TABLE_PATH, load_small_m_table, SmallMTable,
                          "benchmarks/bench_gemm_small_m.py --table")


def _sharded(model: nn.Module) -> bool:
    from sits.runtime.parallel.layers import RowParallelLinear

    return any(isinstance(module, RowParallelLinear) for module in model.modules())


def enable_small_m_gemm(model: nn.Module, device: torch.device, compiled: bool = False) -> int:
    """Install the table of this GPU (`installed_table`) in `model`'s DecodeLinear layers, at start-up
    (before the kernels' pre-tune and graph capture); returns how many layers use the direct kernel.

    Nothing is installed off CUDA, on a tensor-parallel shard or with `compiled` (torch.compile): their
    layers keep F.linear. With float32 activations beside half-precision weights (the model's `activation_dtype`)
    the installed buckets take the float32 rows too (the kernels' two-term dots, autotuned), and every other call
    runs `mixed_linear`.
    """
    if device.type != "cuda" or compiled or _sharded(model):
        return 0
    table = installed_table(torch.cuda.get_device_name(device))
    installed = install_small_m_gemm(model, table) if table.entries else 0
    logger.info("small-M GEMM: %s; %d projections run the direct kernel at some batch size", table.describe(),
                installed)
    return installed
