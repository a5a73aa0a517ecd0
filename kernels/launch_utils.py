"""Helpers shared by the kernel launchers: input checks that raise ValueError, and autotune set-up.

Launchers validate user input here (never with `assert`) so a bad call fails with a message that
names the argument, before any kernel reads memory it should not.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def is_interpreter() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pick_configs(gpu_configs: Sequence, interpreter_config) -> list:
    """The autotune configs for this process: one small config under the interpreter.

    The interpreter cannot autotune over several configs and runs every program instance on the
    CPU, so it gets a single config with small blocks.
    """
    return [interpreter_config] if is_interpreter() else list(gpu_configs)


# Timing budget of one config while autotuning (Triton's default: 25 ms warm-up, 100 ms of runs).
# A kernel of 10 us to 2 ms still gets 12 to 2,500 timed runs, and the start-up pre-tune of every
# bucket (runtime/engine/kernel_warmup.py) takes a quarter of the time.
AUTOTUNE_WARMUP_MS = 5
AUTOTUNE_REP_MS = 25


def _bench_config(kernel_call: Callable[[], None], quantiles: Sequence[float]) -> list[float]:
    """Milliseconds of one config at `quantiles` (the autotuner's benchmark)."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, quantiles=list(quantiles))


def autotune(gpu_configs: Sequence, interpreter_config, key: Sequence[str], prune: Callable | None = None,
             restore_value: Sequence[str] = ()):
    """`triton.autotune` over this process's configs (`pick_configs`), re-tuned for each new value
    of the `key` arguments; `prune(configs, named_args, **kwargs)` drops the configs that cannot
    run a call's shapes before any is timed. Each config is timed for AUTOTUNE_REP_MS. The tensors
    named in `restore_value` (a kernel that updates one in place) are copied back after every timed run."""
    return triton.autotune(configs=pick_configs(gpu_configs, interpreter_config), key=list(key),
                           prune_configs_by=None if prune is None else {"early_config_prune": prune},
                           restore_value=list(restore_value) or None, do_bench=_bench_config)


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds."""
    if not condition:
        raise ValueError(message)


def check_tensor(
    tensor: object,
    name: str,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> None:
    """Check that `tensor` is a torch.Tensor with the given rank, dtype and device."""
    require(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None:
        require(tensor.dim() == ndim, f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        require(
            tensor.dtype in allowed,
            f"{name} must have dtype in {[str(d) for d in allowed]}, got {tensor.dtype}",
        )
    if device is not None:
        require(tensor.device == device, f"{name} must be on {device}, got {tensor.device}")


def check_inner_contiguous(tensor: torch.Tensor, name: str) -> None:
    """The last dimension must have stride 1 (rows are read as contiguous vectors)."""
    require(tensor.stride(-1) == 1 or tensor.shape[-1] == 1, f"{name} must have a contiguous last dimension")


def check_shape(tensor: torch.Tensor, name: str, expected: Sequence[int]) -> None:
    """Exact shape check with a readable message."""
    require(
        tuple(tensor.shape) == tuple(expected),
        f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}",
    )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def length_bucket(n: int, cap: int = 8192) -> int:
    """A power-of-two bucket of a length, used as an autotune key so configs follow the shape."""
    return min(next_power_of_2(max(int(n), 1)), cap)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (a fixed guess on CPU, where only the interpreter runs)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count
