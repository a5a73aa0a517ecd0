"""The fp8 GEMM at decode batches: the direct kernel (one launch, output dtype written in the kernel), the
atomic split-K kernel it replaces, and the rule that picks between them, against fp8_gemm_reference.

On CPU the kernels run in Triton's interpreter with one small config (BLOCK_N 32, BLOCK_K 32), so N
not a multiple of 32 and K not a multiple of 32 exercise the ragged column tile and the masked K tail.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels import fp8_gemm as fp8_gemm_module
from sits.kernels.fp8_gemm import (
    DIRECT_MAX_M,
    SMALL_M,
    fp8_gemm,
    fp8_gemm_reference,
    small_m_direct,
)
from tests.kernels.helpers import DEVICE, ON_GPU
from tests.kernels.test_fp8_gemm import _quantized_operands

# Rows the direct kernel must cover: one token, a tile's worth minus some, just past a 16-row tile.
ODD_SHAPES = [(1, 64, 64), (5, 100, 96), (17, 50, 80), (64, 40, 48)]
ODD_IDS = ["m1", "m5_ragged_n", "m17_ragged_n_k_tail", "m64"]


def _operands(m, n, k, seed):
    torch.manual_seed(seed)
    return _quantized_operands(m, n, k)


def _check(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The product against the float32 reference, within what the output dtype (and, on a GPU, the fp8
    tensor cores' partial sums) allow. The interpreter's fp32->bf16 cast truncates: still < 1 bf16 ulp."""
    assert out.shape == expected.shape and not out.isnan().any()
    if out.dtype == torch.float32 and not ON_GPU:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        return
    tol = {torch.float32: 2e-3, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}[out.dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,n,k", ODD_SHAPES, ids=ODD_IDS)
def test_direct_kernel_matches_reference(m, n, k, out_dtype):
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, n, k, seed=m + n + k)
    out = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype=out_dtype, small_m_kernel="direct")
    assert out.dtype == out_dtype
    _check(out, fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32))


@pytest.mark.parametrize("swap_ab", [False, True], ids=["a_w", "swap_ab"])
@pytest.mark.parametrize("m,n,k", [(5, 100, 96), (17, 50, 80)], ids=["m5", "m17_k_tail"])
def test_direct_kernel_both_operand_orders(m, n, k, swap_ab):
    """Both orientations the GPU configs use: A W^T, and (W A^T)^T with the weight as the MMA's M side."""
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, n, k, seed=7)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEVICE)
    block_k = 32
    fp8_gemm_module._launch_direct(
        fp8_gemm_module._fp8_gemm_direct_kernel, a_fp8, a_scale, w_fp8, w_scale, out, False,
        BLOCK_N=32, BLOCK_K=block_k, SWAP_AB=swap_ab, PROMOTE_K=block_k, EVEN_K=k % block_k == 0,
    )  # fmt: skip
    _check(out, fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32))


def test_direct_kernel_fast_accum_and_strided_rows():
    """fast_accum, and activations that are a row slice of a wider buffer (row stride != K)."""
    m, n, k = 3, 70, 64
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, n, 2 * k, seed=11)
    a_view, w_view = a_fp8[:, :k], w_fp8[:, :k]
    out = fp8_gemm(a_view, a_scale, w_view, w_scale, out_dtype=torch.float16, fast_accum=True, small_m_kernel="direct")
    expected = fp8_gemm_reference(a_view.contiguous(), a_scale, w_view.contiguous(), w_scale, out_dtype=torch.float32)
    _check(out, expected)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_atomic_kernel_still_matches_reference(out_dtype):
    """The split-K kernel stays available (the fallback where the direct one is slower)."""
    m, n, k = 17, 50, 80
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, n, k, seed=3)
    out = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype=out_dtype, small_m_kernel="atomic")
    assert out.dtype == out_dtype
    _check(out, fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32))


def test_direct_and_atomic_agree():
    a_fp8, a_scale, w_fp8, w_scale = _operands(9, 96, 128, seed=5)
    direct = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32, small_m_kernel="direct")
    atomic = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32, small_m_kernel="atomic")
    torch.testing.assert_close(direct, atomic, atol=1e-4, rtol=1e-4)


def test_dispatch_rule():
    """Direct for decode batches up to its row tile where K <= 2 N (Llama-3-8B's qkv, o and gate_up);
    atomic split-K above that batch and for the long-K down projection (K = 3.5 N), as measured."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (1000, 96), (2048, 4096)):
        assert all(small_m_direct(m, n, k) for m in (1, 8, 16, 17, 32, 63, DIRECT_MAX_M))
        assert not any(small_m_direct(m, n, k) for m in (0, DIRECT_MAX_M + 1, SMALL_M))
    for n, k in ((4096, 14336), (2048, 4112)):
        assert not any(small_m_direct(m, n, k) for m in (1, 16, 32, DIRECT_MAX_M))


def test_small_m_kernel_argument_is_checked():
    a_fp8, a_scale, w_fp8, w_scale = _operands(DIRECT_MAX_M + 1, 32, 32, seed=1)
    with pytest.raises(ValueError, match="direct kernel takes M <= 64"):
        fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, small_m_kernel="direct")
    with pytest.raises(ValueError, match="small_m_kernel must be"):
        fp8_gemm(a_fp8[:2], a_scale[:2], w_fp8, w_scale, small_m_kernel="split")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 4160)])
def test_direct_kernel_llama_shapes_gpu(m, n, k):
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, n, k, seed=m)
    expected = fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32)
    for fast_accum in (False, True):
        out = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale, fast_accum=fast_accum, small_m_kernel="direct")
        err = ((out.float() - expected).norm() / expected.norm()).item()
        assert err < (5e-3 if fast_accum else 3e-3)


@pytest.mark.gpu
def test_direct_kernel_replays_in_a_cuda_graph():
    """Decode replays the GEMM in a CUDA graph: new inputs copied in, the right product out, no host sync."""
    m, n, k = 16, 4096, 4096
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, n, k, seed=2)
    fp8_gemm(a_fp8, a_scale, w_fp8, w_scale)  # autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm(a_fp8, a_scale, w_fp8, w_scale)
    new_a, new_scale, _, _ = _operands(m, n, k, seed=3)
    a_fp8.copy_(new_a)
    a_scale.copy_(new_scale)
    graph.replay()
    expected = fp8_gemm_reference(new_a, new_scale, w_fp8, w_scale, out_dtype=torch.float32)
    assert ((out.float() - expected).norm() / expected.norm()).item() < 3e-3


def test_every_gpu_config_of_the_direct_kernel():
    """Each tile shape, operand order and K tile the GPU autotuner may pick, with ragged M, N and K tails."""
    m, n, k = 29, 136, 528  # N past the last column tile of every BLOCK_N, K past the last K tile of every BLOCK_K
    a_fp8, a_scale, w_fp8, w_scale = _operands(m, n, k, seed=13)
    expected = fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32)
    for config in fp8_gemm_module._DIRECT_CONFIGS:
        out = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEVICE)
        fp8_gemm_module._launch_direct(
            fp8_gemm_module._fp8_gemm_direct_kernel, a_fp8, a_scale, w_fp8, w_scale, out, False,
            EVEN_K=k % config.kwargs["BLOCK_K"] == 0, num_warps=config.num_warps, num_stages=config.num_stages,
            **config.kwargs,
        )  # fmt: skip
        _check(out, expected)
