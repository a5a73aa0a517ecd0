"""The small-M GEMMs' folded-norm launches (runtime/models/norm_fold.py) against their references.

- `small_m_gemm_to_stream` (direct kernel) and `small_m_gemm_splitk_to_stream` (split-K): stream += x @ w^T in
  place, the new stream rounded to x's dtype, and its sums of squares per SUMSQ_GROUP columns.
- `small_m_gemm(..., sumsq=)` and `small_m_gemm_silu_mul(..., sumsq=)`: each row scaled by rsqrt(mean square + eps).
- Chained, the two are the decoder norm and the projection: the same as rms_norm then the GEMM with the norm
  weight folded into w, within the rounding that moves.

On CPU the kernels run in Triton's interpreter, with ragged N and K, rows past a 16-row tile and pinned configs.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels.gemm_small_m import (
    SUMSQ_GROUP,
    small_m_gemm,
    small_m_gemm_silu_mul,
    small_m_gemm_to_stream,
    sumsq_slots,
)
from sits.kernels.gemm_small_m_splitk import counters_needed, small_m_gemm_splitk_to_stream
from sits.kernels.reference import (
    rms_norm_reference,
    small_m_gemm_reference,
    small_m_gemm_rstd_reference,
    small_m_gemm_silu_mul_rstd_reference,
    small_m_gemm_to_stream_reference,
)
from tests.kernels.helpers import DEVICE, randn

TOLERANCE = 1e-2  # a bf16 rounding of the output (and of the SiLU·mul's steps), relative to the largest |reference|


def _close(out: torch.Tensor, expected: torch.Tensor, tol: float = TOLERANCE) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype and not out.isnan().any()
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=tol * scale, rtol=tol)


def _operands(m: int, n: int, k: int, seed: int):
    torch.manual_seed(seed)
    x = randn(m, k, dtype=torch.bfloat16)
    w = randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    stream = randn(m, n, dtype=torch.float32)
    return x, w, stream


def _to_stream(kind: str, x, w, stream, config=None):
    if kind == "direct":
        return small_m_gemm_to_stream(x, w, stream, config=config)
    counters = torch.zeros(counters_needed(w.shape[0]), dtype=torch.int32, device=DEVICE)
    result = small_m_gemm_splitk_to_stream(x, w, counters, stream, config=config)
    assert counters.count_nonzero().item() == 0
    return result


@pytest.mark.parametrize("kind", ["direct", "splitk"])
@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (5, 100, 80), (17, 64, 48)], ids=["one-row", "ragged", "two-tiles"])
def test_to_stream_adds_in_place_and_leaves_the_sums_of_squares(kind, m, n, k):
    x, w, stream = _operands(m, n, k, seed=m + n + k)
    expected_stream = stream.clone()
    expected_out, expected_sumsq = small_m_gemm_to_stream_reference(x, w, expected_stream)
    before = stream.data_ptr()
    out, sumsq = _to_stream(kind, x, w, stream)
    assert stream.data_ptr() == before  # in place
    torch.testing.assert_close(stream, expected_stream, atol=1e-5, rtol=1e-5)
    _close(out, expected_out)
    assert sumsq.shape == (m, sumsq_slots(n)) == (m, -(-n // SUMSQ_GROUP)) and sumsq.dtype == torch.float32
    torch.testing.assert_close(sumsq, expected_sumsq, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind,config", [
    ("direct", {"BLOCK_N": 32, "BLOCK_K": 32, "SWAP_AB": 1, "num_warps": 4, "num_stages": 1}),
    ("direct", {"BLOCK_N": 64, "BLOCK_K": 32, "SWAP_AB": 0, "num_warps": 4, "num_stages": 1}),
    ("splitk", {"BLOCK_N": 64, "BLOCK_K": 32, "SWAP_AB": 1, "num_warps": 4, "num_stages": 1, "SPLIT_K": 2}),
])  # fmt: skip
def test_pinned_tiles_of_any_width_fill_every_slot(kind, config):
    """Column tiles of 32 to 64 each write the slots of their columns: the whole sumsq, whatever the config (and
    autotuned on the GPU, where each timed run gets the stream back)."""
    x, w, stream = _operands(3, 100, 80, seed=7)
    expected_stream = stream.clone()
    _, expected_sumsq = small_m_gemm_to_stream_reference(x, w, expected_stream)
    _, sumsq = _to_stream(kind, x, w, stream, config=config)
    torch.testing.assert_close(sumsq, expected_sumsq, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (5, 40, 80), (17, 48, 64)])
def test_row_scaled_gemms_match_their_references(m, n, k):
    x, w, _ = _operands(m, 2 * n, k, seed=m * n)
    sumsq = torch.rand(m, sumsq_slots(k), device=DEVICE) * 4
    _close(small_m_gemm(x, w, sumsq=sumsq, eps=1e-5), small_m_gemm_rstd_reference(x, w, sumsq, 1e-5))
    _close(small_m_gemm_silu_mul(x, w, sumsq=sumsq, eps=1e-5),
           small_m_gemm_silu_mul_rstd_reference(x, w, sumsq, 1e-5), tol=2e-2)
    pinned = {"BLOCK_N": 32, "BLOCK_K": 32, "SWAP_AB": 1, "num_warps": 4, "num_stages": 1}
    _close(small_m_gemm(x, w, config=pinned, sumsq=sumsq, eps=1e-5), small_m_gemm_rstd_reference(x, w, sumsq, 1e-5))


@pytest.mark.parametrize("kind", ["direct", "splitk"])
def test_chained_they_are_the_norm_and_the_projection(kind):
    """o_proj feeding the stream, then qkv_proj with the norm weight folded in: rms_norm(stream + x @ w_o^T, g)
    @ w^T, within the bf16 roundings that move (the GEMM input is the rounded stream, not the rounded x / rms)."""
    m, hidden, n = 4, 96, 80
    x, w_o, stream = _operands(m, hidden, 64, seed=21)
    g = (torch.rand(hidden, device=DEVICE) + 0.5).bfloat16()
    w = randn(n, hidden, dtype=torch.bfloat16, scale=hidden**-0.5)
    summed = stream + small_m_gemm_reference(x, w_o).float()
    expected = small_m_gemm_reference(rms_norm_reference(summed, g, 1e-5).to(torch.bfloat16), w)
    rounded, sumsq = _to_stream(kind, x, w_o, stream)
    folded = (w.float() * g.float()).to(torch.bfloat16)
    _close(small_m_gemm(rounded, folded, sumsq=sumsq, eps=1e-5), expected, tol=3e-2)


def test_bad_input_is_refused():
    x, w, stream = _operands(3, 64, 32, seed=1)
    counters = torch.zeros(counters_needed(64), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="stream"):
        small_m_gemm_to_stream(x, w, stream.half())
    with pytest.raises(ValueError, match="stream"):
        small_m_gemm_splitk_to_stream(x, w, counters, stream[:2])
    with pytest.raises(ValueError, match="sumsq"):
        small_m_gemm(x, w, sumsq=torch.ones(3, 3, device=DEVICE))
    with pytest.raises(ValueError, match="sumsq"):
        small_m_gemm_silu_mul(x, w, sumsq=torch.ones(3, sumsq_slots(32), dtype=torch.float16, device=DEVICE))
    narrow = {"BLOCK_N": 16, "BLOCK_K": 32, "SWAP_AB": 1, "num_warps": 4, "num_stages": 1}
    with pytest.raises(ValueError, match="column tiles of at least 32"):
        small_m_gemm_to_stream(x, w, stream, config=narrow)


def test_the_reference_groups_columns_as_the_kernels_do():
    x, w, stream = _operands(2, 96, 32, seed=4)
    _, sumsq = small_m_gemm_to_stream_reference(x, w, stream)
    assert sumsq.shape == (2, sumsq_slots(96)) and SUMSQ_GROUP * sumsq.shape[1] >= 96 > SUMSQ_GROUP * (sumsq.shape[1] - 1)


def test_an_empty_batch_launches_nothing():
    x, w, stream = _operands(0, 64, 32, seed=2)
    out, sumsq = small_m_gemm_to_stream(x, w, stream)
    assert out.shape == (0, 64) and sumsq.shape == (0, sumsq_slots(64))
