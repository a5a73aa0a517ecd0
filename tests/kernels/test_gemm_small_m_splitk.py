"""The small-M GEMM with K split over programs and reduced in the same launch, against the reference.

On CPU the kernel runs in Triton's interpreter (fp16; its one config splits K three ways over 32-wide
tiles), so ragged N, a K that leaves the last split short or empty, and every GPU config through the raw
kernel are all covered. The counters must be zero after every launch, the sums must not depend on the
order the programs ran in, and bad input is refused.
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.errors import OutOfResources

from sits.kernels import gemm_small_m, gemm_small_m_splitk
from sits.kernels.gemm_small_m_splitk import counters_needed, small_m_gemm_reference, small_m_gemm_splitk
from tests.kernels.helpers import DEVICE, ON_GPU, randn

TOLERANCE = 3e-3  # one fp16 rounding of the output, relative to the largest |reference|


def _operands(m: int, n: int, k: int, seed: int, dtype=torch.float16):
    torch.manual_seed(seed)
    return randn(m, k, dtype=dtype), randn(n, k, dtype=dtype, scale=k**-0.5)


def _check(out: torch.Tensor, expected: torch.Tensor, tol: float = TOLERANCE) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype and not out.isnan().any()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol * scale, rtol=tol)


def _counters(n: int) -> torch.Tensor:
    return torch.zeros(counters_needed(n), dtype=torch.int32, device=DEVICE)


# (N, K): a ragged column tile; K = 80 leaves the third 32-wide split short; K = 40 leaves it empty
@pytest.mark.parametrize("n,k", [(100, 80), (64, 96), (64, 40)], ids=["ragged", "whole", "empty-split"])
@pytest.mark.parametrize("m", [1, 5, 32, 64])
def test_matches_reference_and_leaves_the_counters_zero(m, n, k):
    x, w = _operands(m, n, k, seed=m + n + k)
    counters = _counters(n)
    for _ in range(2):  # the second launch reuses the counters the first one reset
        out = small_m_gemm_splitk(x, w, counters)
        _check(out, small_m_gemm_reference(x, w))
        assert counters.count_nonzero().item() == 0


def test_a_pinned_config_launches_the_raw_kernel():
    """A table's pinned config, for the split-K kernel and the direct one: the same results as autotuned."""
    from sits.kernels.gemm_small_m import small_m_gemm

    x, w = _operands(7, 100, 80, seed=11)
    expected = small_m_gemm_reference(x, w)
    config = {"BLOCK_N": 32, "BLOCK_K": 32, "SWAP_AB": 1, "num_warps": 4, "num_stages": 1}
    counters = _counters(100)
    _check(small_m_gemm_splitk(x, w, counters, config=config | {"SPLIT_K": 2}), expected)
    assert counters.count_nonzero().item() == 0
    _check(small_m_gemm(x, w, config=config | {"SWAP_AB": 0}), expected)
    with pytest.raises(ValueError, match="a pinned config has exactly"):
        small_m_gemm_splitk(x, w, counters, config=config)  # no SPLIT_K
    with pytest.raises(ValueError, match="SPLIT_K <= 8 and BLOCK_N >= 32"):
        small_m_gemm_splitk(x, w, counters, config=config | {"BLOCK_N": 16, "SPLIT_K": 2})


def test_out_buffer_strided_rows_and_empty_batch():
    x, w = _operands(8, 64, 96, seed=3)
    wide = torch.zeros(8, 200, dtype=torch.float16, device=DEVICE)
    wide[:, :96] = x
    out = torch.empty(8, 64, dtype=torch.float16, device=DEVICE)
    assert small_m_gemm_splitk(wide[:, :96], w, _counters(64), out=out) is out
    _check(out, small_m_gemm_reference(x, w))
    assert small_m_gemm_splitk(x[:0], w, _counters(64)).shape == (0, 64)


@pytest.mark.parametrize("m", [1, 33])
def test_every_gpu_config(m):
    """Each config the GPU autotuner may pick, pinned (the raw kernel), with ragged M, N and K (N = 72 past
    every tile width, K = 1,040 over up to 8 splits, the last one short). Configs whose pipeline overflows
    shared memory are skipped on the GPU as the prune skips them."""
    n, k = 72, 1040
    x, w = _operands(m, n, k, seed=17 + m)
    expected = small_m_gemm_reference(x, w)
    block_m = gemm_small_m._block_m(m)
    counters = _counters(n)
    ran = 0
    for config in gemm_small_m_splitk.GPU_CONFIGS:
        if ON_GPU and gemm_small_m_splitk._smem(config, block_m) > gemm_small_m.SMEM_BYTES:
            continue
        pinned = {key: int(value) for key, value in config.kwargs.items()}  # as a measured table pins it
        pinned |= {"num_warps": config.num_warps, "num_stages": config.num_stages}
        try:
            out = small_m_gemm_splitk(x, w, counters, config=pinned)
        except OutOfResources:
            assert ON_GPU
            continue
        _check(out, expected)
        assert counters.count_nonzero().item() == 0
        ran += 1
    assert ran >= len(gemm_small_m_splitk.GPU_CONFIGS) // 2


def test_configs_keep_the_grid_wide_and_the_workspace_large_enough():
    for config in gemm_small_m_splitk.GPU_CONFIGS:
        assert config.kwargs["SPLIT_K"] <= gemm_small_m_splitk.MAX_SPLIT_K
        assert config.kwargs["BLOCK_N"] >= gemm_small_m_splitk.MIN_BLOCK_N
        assert 4096 // config.kwargs["BLOCK_N"] * config.kwargs["SPLIT_K"] >= 128  # ~ one program per SM at N = 4096
    for k in (80, 4096):  # at K = 80 no config's BLOCK_K x SPLIT_K fits K: the fallback must still fit sm_90
        for block_m in (16, 32, 64):
            kept = gemm_small_m_splitk._prune(gemm_small_m_splitk.GPU_CONFIGS, {"K": k}, BLOCK_M=block_m)
            assert kept and all(gemm_small_m_splitk._smem(c, block_m) <= gemm_small_m.SMEM_BYTES for c in kept)


def test_bad_inputs_raise_value_error():
    x, w = _operands(4, 64, 96, seed=5)
    with pytest.raises(ValueError, match="counters holds 1 counters; N = 64 needs at least 2"):
        small_m_gemm_splitk(x, w, torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="counters"):
        small_m_gemm_splitk(x, w, torch.zeros(8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="at most 64 rows"):
        small_m_gemm_splitk(torch.zeros(65, 96, dtype=torch.float16, device=DEVICE), w, _counters(64))
    with pytest.raises(ValueError):
        small_m_gemm_splitk(x, w.t(), _counters(64))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (32, 4096, 4096), (32, 4096, 14336), (64, 4096, 14336)])
def test_llama_shapes_bf16_gpu_and_in_a_cuda_graph(m, n, k):
    x, w = _operands(m, n, k, seed=m, dtype=torch.bfloat16)
    counters = _counters(n)
    expected = small_m_gemm_reference(x, w)
    _check(small_m_gemm_splitk(x, w, counters), expected, 1.6e-2)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small_m_gemm_splitk(x, w, counters, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    _check(out, expected, 1.6e-2)
    assert counters.count_nonzero().item() == 0
    first = small_m_gemm_splitk(x, w, counters)
    assert torch.equal(first, small_m_gemm_splitk(x, w, counters))  # split order fixed: the same bits every time
