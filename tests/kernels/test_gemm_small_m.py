"""The bf16 / fp16 direct GEMM at decode batches, plain and with SiLU·mul fused, against the references.

On CPU the kernel runs in Triton's interpreter with one small config (BLOCK_N 32, BLOCK_K 32), so N not a
multiple of 32 and K not a multiple of 32 exercise the ragged column tile and the masked K tail; the
interpreter upcasts the tiles to float32 before the dot (it multiplies bf16 as raw bits) and truncates the
float32 -> bf16 store (within one bf16 step). Every GPU config is also launched once through it.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.errors import OutOfResources

from sits.kernels import gemm_small_m as kernel_module
from sits.kernels.gemm_small_m import (
    MAX_M,
    small_m_gemm,
    small_m_gemm_reference,
    small_m_gemm_silu_mul,
    small_m_gemm_silu_mul_reference,
    small_m_rows_bucket,
)
from sits.kernels.reference import silu_mul_reference
from tests.kernels.helpers import DEVICE, ON_GPU, randn

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
ROWS = [1, 3, 16, 33, 64]
# (N, K): ragged column tile and K tail; whole tiles
SHAPES = [(100, 80), (64, 96)]
# relative to the largest |reference|: one or two roundings of the output dtype (the interpreter's
# bf16 store truncates); SiLU·mul rounds three times, each step's error carried into the next
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 1.6e-2}
SILU_TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def _operands(m: int, rows: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return randn(m, k, dtype=dtype), randn(rows, k, dtype=dtype, scale=k**-0.5)


def _check(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype and not out.isnan().any()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES, ids=["ragged", "whole"])
@pytest.mark.parametrize("m", ROWS)
def test_gemm_matches_reference(m, n, k, dtype):
    x, w = _operands(m, n, k, dtype, seed=m + n + k)
    out = small_m_gemm(x, w)
    _check(out, small_m_gemm_reference(x, w), TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES, ids=["ragged", "whole"])
@pytest.mark.parametrize("m", ROWS)
def test_silu_mul_matches_reference(m, n, k, dtype):
    """Gate rows first, then up (LlamaMLP's gate_up_proj): [M, 2N] of products, N outputs."""
    x, w = _operands(m, 2 * n, k, dtype, seed=m + n + k + 1)
    out = small_m_gemm_silu_mul(x, w)
    expected = small_m_gemm_silu_mul_reference(x, w)
    assert expected.shape == (m, n)
    _check(out, expected, SILU_TOLERANCE[dtype])
    gate_up = small_m_gemm_reference(x, w)  # the layout: exactly what silu_mul reads from the unfused GEMM
    torch.testing.assert_close(expected, silu_mul_reference(gate_up), atol=0, rtol=0)


def test_out_buffer_and_strided_rows():
    """Activations that are a row slice of a wider buffer (row stride != K), and a caller's output buffer."""
    m, n, k = 5, 70, 64
    x_wide, w = _operands(m, n, 2 * k, torch.float16, seed=11)
    x, w = x_wide[:, :k], w[:, :k]
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
    assert small_m_gemm(x, w, out=out) is out
    _check(out, small_m_gemm_reference(x.contiguous(), w.contiguous()), TOLERANCE[torch.float16])
    fused = torch.full((m, n // 2), float("nan"), dtype=torch.float16, device=DEVICE)
    assert small_m_gemm_silu_mul(x, w, out=fused) is fused
    _check(fused, small_m_gemm_silu_mul_reference(x.contiguous(), w.contiguous()), SILU_TOLERANCE[torch.float16])


def test_empty_batch():
    x, w = _operands(0, 48, 32, torch.float16, seed=1)
    assert small_m_gemm(x, w).shape == (0, 48)
    assert small_m_gemm_silu_mul(x, w).shape == (0, 24)


def launch_config(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, silu_mul: bool, config) -> bool:
    """The raw kernel at one config (no autotuning) writing out; False where it cannot launch (OutOfResources)."""
    try:
        kernel_module.launch(
            kernel_module._small_m_gemm_kernel, x, w, out, silu_mul,
            EVEN_K=x.shape[1] % config.kwargs["BLOCK_K"] == 0, num_warps=config.num_warps,
            num_stages=config.num_stages, **config.kwargs,
        )  # fmt: skip
    except OutOfResources:
        return False
    return True


@pytest.mark.parametrize("variant", ["gemm", "silu_mul"])
@pytest.mark.parametrize("m", [5, 29, 64])
def test_every_gpu_config(m, variant):
    """Each tile shape, operand order and K tile the GPU autotuner may pick, at each row tile (16, 32, 64),
    with ragged M, N and K tails: N past the last column tile of every BLOCK_N, K past the last K tile.
    (On a GPU, configs whose pipeline overflows shared memory at this row tile cannot launch: the
    autotuner's prune drops them, and so does this test; one that another Triton release lays out larger
    fails to launch with OutOfResources, which the autotuner skips too. The interpreter runs them all.)"""
    n, k = 72, 528
    silu_mul = variant == "silu_mul"
    x, w = _operands(m, 2 * n if silu_mul else n, k, torch.float16, seed=13 + m)
    expected = small_m_gemm_silu_mul_reference(x, w) if silu_mul else small_m_gemm_reference(x, w)
    block_m = kernel_module._block_m(m)
    ran = 0
    for config in kernel_module.GPU_CONFIGS:
        if ON_GPU and kernel_module.shared_memory_bytes(config, block_m, silu_mul) > kernel_module.SMEM_BYTES:
            continue
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
        if not launch_config(x, w, out, silu_mul, config):
            assert ON_GPU
            continue
        _check(out, expected, (SILU_TOLERANCE if silu_mul else TOLERANCE)[torch.float16])
        ran += 1
    # 3: the fewest that fit sm_90's shared memory, 64-row tiles with SiLU·mul (H200, Triton 3.6)
    assert ran >= 3


def test_configs_fit_the_grid_and_shared_memory():
    """At N = 4,096 the narrowest configs give ~2 programs per SM of an H200 (132); the autotuner keeps,
    at each row tile, only configs whose pipeline fits sm_90's shared memory."""
    assert min(c.kwargs["BLOCK_N"] for c in kernel_module.GPU_CONFIGS) == 16  # 256 programs at N = 4096
    for block_m in (16, 32, 64):
        for silu_mul in (False, True):
            kept = kernel_module._prune(kernel_module.GPU_CONFIGS, {"K": 4096}, BLOCK_M=block_m, SILU_MUL=silu_mul)
            assert len(kept) >= (3 if silu_mul and block_m == 64 else 4)
            assert all(kernel_module.shared_memory_bytes(c, block_m, silu_mul) <= kernel_module.SMEM_BYTES
                       for c in kept)
    wide_k_tiles = kernel_module._prune(kernel_module.GPU_CONFIGS, {"K": 128}, BLOCK_M=16)
    assert all(c.kwargs["BLOCK_K"] <= 128 for c in wide_k_tiles)


def test_rows_bucket():
    assert [small_m_rows_bucket(m) for m in (1, 2, 3, 5, 16, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert [kernel_module._block_m(m) for m in (1, 15, 16, 17, 33, 64)] == [16, 16, 16, 32, 64, 64]


def test_bad_inputs_raise_value_error():
    x, w = _operands(4, 32, 64, torch.float16, seed=2)
    cases = [
        (lambda: small_m_gemm(randn(MAX_M + 1, 64, dtype=torch.float16), w), "at most 64 rows"),
        (lambda: small_m_gemm(x.double(), w), "x must have dtype"),
        (lambda: small_m_gemm(x.float(), w.float()), "w must have dtype"),  # float32 x: a half-precision w
        (lambda: small_m_gemm(x, w.to(torch.bfloat16)), "w must have dtype"),
        (lambda: small_m_gemm(x, w[:, :32]), "expected \\[rows, 64\\]"),
        (lambda: small_m_gemm(x[0], w), "x must have 2 dimensions"),
        (lambda: small_m_gemm(x, w.t().contiguous().t()), "w must have a contiguous last dimension"),
        (lambda: small_m_gemm(x, w, out=torch.empty(4, 31, dtype=torch.float16, device=DEVICE)), "out must have"),
        (lambda: small_m_gemm(x, w, out=torch.empty(4, 32, device=DEVICE)), "out must have dtype"),
        (lambda: small_m_gemm(x[:, :0], w[:, :0]), "K must be positive"),
        (lambda: small_m_gemm_silu_mul(x, w[:31]), "even number of rows"),
        (lambda: small_m_gemm_silu_mul(x, w, out=torch.empty(4, 32, dtype=torch.float16, device=DEVICE)),
         "out must have shape \\(4, 16\\)"),
        (lambda: small_m_gemm(x.tolist(), w), "x must be a torch.Tensor"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 4160)])
def test_llama_shapes_gpu(m, n, k):
    x, w = _operands(m, n, k, torch.bfloat16, seed=m)
    expected = small_m_gemm_reference(x, w).float()
    out = small_m_gemm(x, w).float()
    assert ((out - expected).norm() / expected.norm()).item() < 4e-3
    fused = small_m_gemm_silu_mul(x, w).float()
    expected = small_m_gemm_silu_mul_reference(x, w).float()
    assert ((fused - expected).norm() / expected.norm()).item() < 8e-3


@pytest.mark.gpu
def test_replays_in_a_cuda_graph():
    """Decode replays the GEMM in a CUDA graph: new inputs copied in, the right product out, no host sync."""
    m, n, k = 16, 4096, 4096
    x, w = _operands(m, n, k, torch.bfloat16, seed=2)
    small_m_gemm(x, w)  # autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_gemm(x, w)
    new_x, _ = _operands(m, n, k, torch.bfloat16, seed=3)
    x.copy_(new_x)
    graph.replay()
    expected = small_m_gemm_reference(new_x, w).float()
    assert ((out.float() - expected).norm() / expected.norm()).item() < 4e-3
