"""The small-M GEMMs with float32 activations beside a half-precision weight (--activation-dtype float32).

Each float32 activation tile enters the dots as two terms of the weight's dtype, hi = the tile rounded and lo =
what hi leaves, rounded, with float32 sums: about twice the weight dtype's mantissa of x, as `mixed_linear`'s two
GEMMs keep, in one launch and one pass over the weight. The output is float32, unrounded. On the CPU (Triton's
interpreter) the weight is float16, whose two terms carry 22 bits of x: the products then match the float64
product to float32 accuracy; the GPU tests run bfloat16 (16 bits) and every config the autotuner may pick.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels import gemm_small_m as kernel_module
from sits.kernels.gemm_small_m import small_m_gemm, small_m_gemm_silu_mul, small_m_gemm_to_stream
from sits.kernels.gemm_small_m_splitk import counters_needed, small_m_gemm_splitk
from sits.kernels.reference import silu_mul_reference
from tests.kernels.helpers import DEVICE, ON_GPU, randn
from tests.kernels.test_gemm_small_m import launch_config

WEIGHT_DTYPE = torch.bfloat16 if ON_GPU else torch.float16  # the interpreter mis-rounds bfloat16
# Relative to the largest |float64 product|: two terms of x keep 16 (bf16) or 22 (fp16) bits; x rounded to the
# weight's dtype first keeps 8 or 11.
TOLERANCE = 2e-5 if ON_GPU else 2e-6


def _operands(m: int, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return randn(m, k), randn(rows, k, dtype=WEIGHT_DTYPE, scale=k**-0.5)


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t()


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert out.dtype == torch.float32 and out.shape == expected.shape and not out.isnan().any()
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n,k", [(100, 80), (64, 96)], ids=["ragged", "whole"])
def test_float32_x_keeps_its_low_bits(m, n, k):
    """The float32 product of the float32 activations, far closer than with x rounded to the weight's dtype."""
    x, w = _operands(m, n, k, seed=m + n + k)
    out = small_m_gemm(x, w)
    exact = _exact(x, w)
    assert _relative_error(out, exact) < TOLERANCE
    rounded = small_m_gemm(x.to(WEIGHT_DTYPE), w).float()
    assert _relative_error(rounded, exact) > 20 * TOLERANCE


@pytest.mark.parametrize("m", [1, 17])
def test_float32_x_with_silu_mul(m):
    """gate_up + SiLU·mul in one launch from float32 activations: silu(gate) * up in float32, nothing rounded."""
    n, k = 72, 96
    x, w = _operands(m, 2 * n, k, seed=m)
    out = small_m_gemm_silu_mul(x, w)
    expected = silu_mul_reference(_exact(x, w))
    assert out.shape == (m, n)
    assert _relative_error(out, expected) < 2 * TOLERANCE


@pytest.mark.parametrize("m", [1, 32])
def test_float32_x_split_k(m):
    """K split over programs and reduced in the launch: the same float32 product, the counters back at zero."""
    n, k = 96, 200
    x, w = _operands(m, n, k, seed=40 + m)
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device=DEVICE)
    out = small_m_gemm_splitk(x, w, counters)
    assert _relative_error(out, _exact(x, w)) < TOLERANCE
    assert counters.count_nonzero() == 0


def test_what_float32_x_does_not_take():
    """A float32 weight, the folded norm's row scaling and the stream-feeding launch keep half-precision x only;
    the output buffer must be float32."""
    x, w = _operands(3, 64, 64, seed=1)
    with pytest.raises(ValueError, match="w must have dtype in"):
        small_m_gemm(x, w.float())
    sumsq = torch.ones(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="x must have dtype in"):
        small_m_gemm(x, w, sumsq=sumsq, eps=1e-6)
    with pytest.raises(ValueError, match="x must have dtype in"):
        small_m_gemm_to_stream(x, w, torch.zeros(3, 64, device=DEVICE))
    with pytest.raises(ValueError, match="out must have dtype in"):
        small_m_gemm(x, w, out=torch.empty(3, 64, dtype=WEIGHT_DTYPE, device=DEVICE))


def test_the_prune_counts_float32_tiles():
    """With a float32 x the autotuner keeps only configs whose pipeline, four bytes an activation element and the
    two staged terms, fits shared memory: fewer at 64-row tiles than with a half-precision x, and at least one at
    every row tile, plain and with SiLU·mul."""
    x32, x16 = torch.empty(64, 4096), torch.empty(64, 4096, dtype=torch.float16)
    for block_m in (16, 64):
        kept32 = kernel_module._prune(kernel_module.GPU_CONFIGS, {"K": 4096, "x_ptr": x32}, BLOCK_M=block_m)
        kept16 = kernel_module._prune(kernel_module.GPU_CONFIGS, {"K": 4096, "x_ptr": x16}, BLOCK_M=block_m)
        assert kept32 and set(map(str, kept32)) <= set(map(str, kept16))
        assert all(kernel_module.shared_memory_bytes(c, block_m, x_bytes=4) <= kernel_module.SMEM_BYTES for c in kept32)
    assert kernel_module.shared_memory_bytes(kernel_module.GPU_CONFIGS[0], 64, x_bytes=4) > \
        kernel_module.shared_memory_bytes(kernel_module.GPU_CONFIGS[0], 64)
    for block_m in (16, 32, 64):
        for silu_mul in (False, True):
            assert any(kernel_module.shared_memory_bytes(c, block_m, silu_mul, x_bytes=4) <= kernel_module.SMEM_BYTES
                       for c in kernel_module.GPU_CONFIGS), (block_m, silu_mul)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("silu_mul", [False, True], ids=["gemm", "silu_mul"])
@pytest.mark.parametrize("m", [1, 29, 64])
def test_every_gpu_config_with_float32_x(m, silu_mul):
    """Every config the autotuner keeps for a float32 x compiles and gives the float32 product on the GPU."""
    n, k = 72, 528
    x, w = _operands(m, 2 * n if silu_mul else n, k, seed=13 + m)
    exact = _exact(x, w)
    expected = silu_mul_reference(exact) if silu_mul else exact
    block_m = kernel_module._block_m(m)
    ran = 0
    for config in kernel_module.GPU_CONFIGS:
        if kernel_module.shared_memory_bytes(config, block_m, silu_mul, x_bytes=4) > kernel_module.SMEM_BYTES:
            continue
        out = torch.full((m, n), float("nan"), device=DEVICE)
        if not launch_config(x, w, out, silu_mul, config):
            continue
        assert _relative_error(out, expected) < 2 * TOLERANCE, config
        ran += 1
    assert ran >= 1  # the prune keeps one at 64-row tiles with SiLU·mul (32 x 128, 4 stages), 3 to 10 elsewhere
