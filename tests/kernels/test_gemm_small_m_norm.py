"""The decoder norm fused into the small-M direct GEMM (sits.kernels.gemm_small_m_norm), plain and SiLU·mul.

On CPU the kernels run in Triton's interpreter with one small config (BLOCK_N 32, BLOCK_K 32): K = 80 has a
masked K tail and a first-pass row block of 128 (>= K, partly masked), N = 100 a ragged column tile. Under
the interpreter the fused launch equals the unfused Triton path (sits.kernels.rmsnorm.rms_norm, then
small_m_gemm / small_m_gemm_silu_mul with the same config) bit for bit: the normed activations are the norm
kernel's exactly, and the stream written is the norm kernel's exactly. Against the float32-sum references the
usual GEMM tolerances apply (the interpreter truncates the float32 -> bf16 store).
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.errors import OutOfResources

from sits.kernels import gemm_small_m_norm as kernel_module
from sits.kernels.gemm_small_m import SMEM_BYTES, small_m_gemm, small_m_gemm_silu_mul
from sits.kernels.gemm_small_m_norm import (
    NORM_MAX_M,
    small_m_norm_gemm,
    small_m_norm_gemm_reference,
    small_m_norm_gemm_silu_mul,
    small_m_norm_gemm_silu_mul_reference,
)
from sits.kernels.rmsnorm import rms_norm
from tests.kernels.helpers import DEVICE, ON_GPU, randn

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
ROWS = [1, 3, 8]
N, K, EPS = 100, 80, 1e-5
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 1.6e-2}
SILU_TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def _operands(m: int, rows: int, dtype: torch.dtype, seed: int, k: int = K):
    """x [m, k] (a sublayer's output), the float32 stream [m, k], the norm weight [k], w [rows, k]."""
    torch.manual_seed(seed)
    x = randn(m, k, dtype=dtype)
    residual = randn(m, k, dtype=torch.float32) * 4
    norm_weight = (1 + 0.1 * randn(k, dtype=torch.float32)).to(dtype)
    return x, residual, norm_weight, randn(rows, k, dtype=dtype, scale=k**-0.5)


def _unfused(x, residual, norm_weight, w, silu_mul: bool, stream_dtype=None):
    """The engine's unfused path: the Triton norm (the add or the stream's cast fused), then the GEMM."""
    normed = torch.empty_like(x)
    if residual is not None:
        normed, stream = rms_norm(x, norm_weight, EPS, residual=residual, out=normed,
                                  residual_out=torch.empty_like(residual))  # fmt: skip
    elif stream_dtype not in (None, x.dtype):
        normed, stream = rms_norm(x, norm_weight, EPS, out=normed, residual_out=torch.empty(x.shape, dtype=stream_dtype,
                                  device=x.device))  # fmt: skip
    else:
        normed, stream = rms_norm(x, norm_weight, EPS, out=normed), x
    return (small_m_gemm_silu_mul if silu_mul else small_m_gemm)(normed, w), stream


def _check(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype and not out.isnan().any()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("m", ROWS)
def test_matches_the_unfused_path_and_the_reference(m, silu_mul, dtype):
    x, residual, norm_weight, w = _operands(m, 2 * N if silu_mul else N, dtype, seed=m + 7 * silu_mul)
    before = residual.clone()
    fused = small_m_norm_gemm_silu_mul if silu_mul else small_m_norm_gemm
    out, stream = fused(x, residual, norm_weight, EPS, w)
    assert torch.equal(residual, before)  # the stream passed in is read, never written
    unfused_out, unfused_stream = _unfused(x, residual, norm_weight, w, silu_mul)
    assert stream.dtype == torch.float32 and torch.equal(stream, unfused_stream)
    assert torch.equal(stream, residual + x.float())
    if not ON_GPU:  # the interpreter: the same normed activations and the same config, bit for bit
        assert torch.equal(out, unfused_out)
    reference = small_m_norm_gemm_silu_mul_reference if silu_mul else small_m_norm_gemm_reference
    expected, expected_stream = reference(x, residual, norm_weight, EPS, w)
    assert torch.equal(stream, expected_stream)
    _check(out, expected, (SILU_TOLERANCE if silu_mul else TOLERANCE)[dtype])


@pytest.mark.parametrize("stream_dtype", [torch.float32, torch.float16, None], ids=["fp32", "own", "none"])
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
def test_first_layer_starts_the_stream(stream_dtype, silu_mul):
    """No residual (the embedding rows start the stream): residual_new is x in the stream's dtype, or x itself."""
    x, _, norm_weight, w = _operands(3, 2 * N if silu_mul else N, torch.float16, seed=21)
    fused = small_m_norm_gemm_silu_mul if silu_mul else small_m_norm_gemm
    out, stream = fused(x, None, norm_weight, EPS, w, stream_dtype=stream_dtype)
    if stream_dtype in (None, torch.float16):
        assert stream is x
    else:
        assert stream.dtype == stream_dtype and torch.equal(stream, x.to(stream_dtype))
    unfused_out, _ = _unfused(x, None, norm_weight, w, silu_mul, stream_dtype)
    if not ON_GPU:
        assert torch.equal(out, unfused_out)
    reference = small_m_norm_gemm_silu_mul_reference if silu_mul else small_m_norm_gemm_reference
    _check(out, reference(x, None, norm_weight, EPS, w, stream_dtype)[0],
           (SILU_TOLERANCE if silu_mul else TOLERANCE)[torch.float16])


def test_half_precision_stream_and_buffers():
    """A stream kept in the model dtype (residual_dtype None) is rounded after the add, as rms_norm rounds it;
    caller buffers are filled and returned."""
    x, residual, norm_weight, w = _operands(5, N, torch.float16, seed=3)
    residual = residual.half()
    out = torch.full((5, N), float("nan"), dtype=torch.float16, device=DEVICE)
    stream = torch.full_like(residual, float("nan"))
    got = small_m_norm_gemm(x, residual, norm_weight, EPS, w, out=out, residual_out=stream)
    assert got[0] is out and got[1] is stream
    unfused_out, unfused_stream = _unfused(x, residual, norm_weight, w, False)
    assert torch.equal(stream, unfused_stream)
    if not ON_GPU:
        assert torch.equal(out, unfused_out)


def test_empty_batch_and_no_columns():
    x, residual, norm_weight, w = _operands(0, N, torch.float16, seed=1)
    out, stream = small_m_norm_gemm(x, residual, norm_weight, EPS, w)
    assert out.shape == (0, N) and stream.shape == (0, K)
    x, residual, norm_weight, w = _operands(2, 0, torch.float16, seed=1)
    out, stream = small_m_norm_gemm(x, residual, norm_weight, EPS, w)
    assert out.shape == (2, 0) and torch.equal(stream, residual + x.float())


@pytest.mark.parametrize("variant", ["gemm", "silu_mul"])
@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "first_layer"])
def test_every_gpu_config(variant, has_residual):
    """Each tile shape, operand order and K tile the GPU autotuner may pick, with ragged N and K tails (K past
    the last K tile of every BLOCK_K, and a first-pass row block of 1,024 for K = 528); M = 5 in its 16-row
    tile. Configs whose pipeline overflows shared memory are pruned on a GPU, and skipped here there."""
    m, n, k = 5, 72, 528
    silu_mul = variant == "silu_mul"
    x, residual, norm_weight, w = _operands(m, 2 * n if silu_mul else n, torch.float16, seed=13, k=k)
    residual = residual if has_residual else None
    reference = small_m_norm_gemm_silu_mul_reference if silu_mul else small_m_norm_gemm_reference
    expected, expected_stream = reference(x, residual, norm_weight, EPS, w, torch.float32)
    ran = 0
    for config in kernel_module.NORM_GPU_CONFIGS:
        if ON_GPU and kernel_module.shared_memory_bytes(config, 16, silu_mul) > SMEM_BYTES:
            continue
        out = torch.full((m, n), float("nan"), dtype=torch.float16, device=DEVICE)
        stream = torch.full((m, k), float("nan"), device=DEVICE)
        try:
            kernel_module.launch(
                kernel_module._small_m_norm_gemm_kernel, x, residual, norm_weight, EPS, w, out, stream, silu_mul,
                EVEN_K=k % config.kwargs["BLOCK_K"] == 0, num_warps=config.num_warps, num_stages=config.num_stages,
                **config.kwargs,
            )  # fmt: skip
        except OutOfResources:
            assert ON_GPU
            continue
        assert torch.equal(stream, expected_stream), config
        _check(out, expected, (SILU_TOLERANCE if silu_mul else TOLERANCE)[torch.float16])
        ran += 1
    assert ran >= 4


def test_configs_fit_shared_memory():
    """The prune keeps, at the 16-row tile, configs whose pipeline fits sm_90's shared memory."""
    for silu_mul in (False, True):
        kept = kernel_module._prune(kernel_module.NORM_GPU_CONFIGS, {"K": 4096}, BLOCK_M=16, SILU_MUL=silu_mul)
        assert len(kept) >= 4
        assert all(kernel_module.shared_memory_bytes(c, 16, silu_mul) <= SMEM_BYTES for c in kept)
    assert all(c.kwargs["BLOCK_K"] <= 256 for c in kernel_module.NORM_GPU_CONFIGS)


def test_bad_inputs_raise_value_error():
    x, residual, nw, w = _operands(4, 32, torch.float16, seed=2)
    f = small_m_norm_gemm
    cases = [
        (lambda: f(randn(NORM_MAX_M + 1, K, dtype=torch.float16), None, nw, EPS, w), "at most 8 rows"),
        (lambda: f(x.float(), residual, nw, EPS, w.float()), "x must have dtype"),
        (lambda: f(x, residual, nw, EPS, w.to(torch.bfloat16)), "w must have dtype"),
        (lambda: f(x, residual, nw, EPS, w[:, :64]), "expected \\[rows, 80\\]"),
        (lambda: f(x, residual[:3], nw, EPS, w), "residual must have shape"),
        (lambda: f(x, residual.to(torch.int32), nw, EPS, w), "residual must have dtype"),
        (lambda: f(x, residual, nw[:64], EPS, w), "norm_weight must have shape"),
        (lambda: f(x, residual, nw, -1.0, w), "eps must be a non-negative number"),
        (lambda: f(x, residual, nw, EPS, w, residual_out=residual), "residual_out must not overlap residual"),
        (lambda: f(x, residual, nw, EPS, w, residual_out=torch.empty(4, K, dtype=torch.float16, device=DEVICE)),
         "residual_out must have dtype"),
        (lambda: f(x, None, nw, EPS, w, residual_out=torch.empty(4, K, device=DEVICE)), "nothing is written"),
        (lambda: f(x, residual, nw, EPS, w, stream_dtype=torch.float16), "stream_dtype"),
        (lambda: f(x, None, nw, EPS, w, stream_dtype=torch.int8), "stream_dtype must be one of"),
        (lambda: f(x, residual, nw, EPS, w, out=torch.empty(4, 31, dtype=torch.float16, device=DEVICE)),
         "out must have"),
        (lambda: small_m_norm_gemm_silu_mul(x, residual, nw, EPS, w[:31]), "even number of rows"),
        (lambda: f(x.tolist(), residual, nw, EPS, w), "x must be a torch.Tensor"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [6144, 28672])
def test_llama_shapes_gpu(m, n):
    x, residual, norm_weight, w = _operands(m, n, torch.bfloat16, seed=m, k=4096)
    silu_mul = n == 28672
    fused = small_m_norm_gemm_silu_mul if silu_mul else small_m_norm_gemm
    reference = small_m_norm_gemm_silu_mul_reference if silu_mul else small_m_norm_gemm_reference
    out, stream = fused(x, residual, norm_weight, EPS, w)
    expected, expected_stream = reference(x, residual, norm_weight, EPS, w)
    assert torch.equal(stream, expected_stream)
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() < 8e-3


@pytest.mark.gpu
def test_replays_in_a_cuda_graph():
    """Decode replays the fused launch in a CUDA graph: new x and stream copied in, the right product and stream
    out, no host sync."""
    x, residual, norm_weight, w = _operands(1, 6144, torch.bfloat16, seed=2, k=4096)
    small_m_norm_gemm(x, residual, norm_weight, EPS, w)  # autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, stream = small_m_norm_gemm(x, residual, norm_weight, EPS, w)
    new_x, new_residual, _, _ = _operands(1, 6144, torch.bfloat16, seed=3, k=4096)
    x.copy_(new_x)
    residual.copy_(new_residual)
    graph.replay()
    expected, expected_stream = small_m_norm_gemm_reference(new_x, new_residual, norm_weight, EPS, w)
    assert torch.equal(stream, expected_stream)
    assert ((out.float() - expected.float()).norm() / expected.float().norm()).item() < 4e-3
