"""sits.kernels.fused_mlp: the folded decode MLP in one launch is the two launches it replaces, bit for bit.

The two launches: `small_m_gemm_silu_mul(x, w_gate_up, sumsq=, eps=)` then `small_m_gemm_splitk_to_stream`, pinned at
the fused launch's tiles, so each sum runs the same loop in the same order. On the CPU (Triton's interpreter) the
fused launch is one program that runs every unit; on a GPU it is the whole cooperative grid, eagerly and captured in
a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from sits.kernels.fused_mlp import DEFAULT_CONFIG, FusedMlpWork, fits_at_once, fused_decode_mlp
from sits.kernels.gemm_small_m import small_m_gemm_silu_mul, sumsq_slots
from sits.kernels.gemm_small_m_splitk import counters_needed, small_m_gemm_splitk_to_stream
from tests.kernels.helpers import DEVICE, ON_GPU, randn

EPS = 1e-5
TOY_CONFIG = {"BLOCK_I": 32, "BLOCK_N": 32, "K_SPLIT": 2, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


def _operands(m: int, k: int, inter: int, n: int, seed: int = 0):
    torch.manual_seed(seed)
    x = randn(m, k, dtype=torch.bfloat16)
    sumsq = randn(m, sumsq_slots(k)).abs() * 32  # a mean square near 1
    w_gate_up = randn(2 * inter, k, dtype=torch.bfloat16, scale=k**-0.5)
    w_down = randn(n, inter, dtype=torch.bfloat16, scale=inter**-0.5)
    stream = randn(m, n)
    return x, sumsq, w_gate_up, w_down, stream


def _two_launches(x, sumsq, w_gate_up, w_down, stream, config):
    """The folded layer's two launches at the fused launch's tiles: (out, sumsq_out), stream updated in place."""
    common = {"BLOCK_K": config["BLOCK_K"], "SWAP_AB": 1, "num_warps": config["num_warps"],
              "num_stages": config["num_stages"]}
    h = small_m_gemm_silu_mul(x, w_gate_up, config={"BLOCK_N": config["BLOCK_I"], **common}, sumsq=sumsq, eps=EPS)
    counters = torch.zeros(counters_needed(w_down.shape[0]), dtype=torch.int32, device=DEVICE)
    return small_m_gemm_splitk_to_stream(h, w_down, counters, stream,
                                         config={"BLOCK_N": config["BLOCK_N"], "SPLIT_K": config["K_SPLIT"], **common})


def _check_same(operands, config, work: FusedMlpWork, runs: int = 1) -> None:
    x, sumsq, w_gate_up, w_down, stream = operands
    expected_stream = stream.clone()
    expected_out, expected_sumsq = _two_launches(x, sumsq, w_gate_up, w_down, expected_stream, config)
    out, sumsq_out = fused_decode_mlp(x, sumsq, EPS, w_gate_up, w_down, stream, work, config)
    assert torch.equal(out, expected_out) and torch.equal(sumsq_out, expected_sumsq)
    assert torch.equal(stream, expected_stream)
    assert not work.gave_up() and int(work.barrier[0]) == 0 and work.tiles.count_nonzero().item() == 0


@pytest.mark.parametrize(("m", "prefetch"), [(1, 0), (3, 0), (16, 0), (1, 64)])
def test_the_fused_launch_is_the_two_launches_bit_for_bit(m, prefetch):
    """PREFETCH only queues bytes for L2 (sm_90; nothing under the interpreter): the sums are the same."""
    operands = _operands(m, k=64, inter=128, n=64)
    if prefetch and ON_GPU and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("bulk L2 prefetches need sm_90")
    config = {**TOY_CONFIG, "PREFETCH": prefetch, "num_stages": 3 if ON_GPU else 1}
    _check_same(operands, config, FusedMlpWork.new(64, 128, torch.bfloat16, DEVICE))


def test_a_second_launch_on_the_same_buffers_adds_again():
    """The counters are zero after a launch, so the next one (the next layer's, or a replay) runs as the first."""
    x, sumsq, w_gate_up, w_down, stream = _operands(2, k=64, inter=128, n=64, seed=1)
    work = FusedMlpWork.new(64, 128, torch.bfloat16, DEVICE)
    before = stream.clone()
    fused_decode_mlp(x, sumsq, EPS, w_gate_up, w_down, stream, work, TOY_CONFIG)
    once = stream - before
    fused_decode_mlp(x, sumsq, EPS, w_gate_up, w_down, stream, work, TOY_CONFIG)
    torch.testing.assert_close(stream - before, 2 * once, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    ({"m": 17}, "1 to 16 rows"),
    ({"config": {**TOY_CONFIG, "K_SPLIT": 3}}, "does not divide"),
    ({"config": {**TOY_CONFIG, "BLOCK_N": 16}}, "does not divide"),
    ({"config": {**TOY_CONFIG, "PREFETCH": 24}}, "does not divide"),  # whole 16-byte lines
    ({"config": {**TOY_CONFIG, "PREFETCH": 144}}, "does not divide"),  # past a 64-column bf16 slice
    ({"stream_dtype": torch.bfloat16}, "stream"),
])
def test_bad_input_is_refused(change, message):
    x, sumsq, w_gate_up, w_down, stream = _operands(change.get("m", 1), k=64, inter=128, n=64)
    if "stream_dtype" in change:
        stream = stream.to(change["stream_dtype"])
    with pytest.raises(ValueError, match=message):
        fused_decode_mlp(x, sumsq, EPS, w_gate_up, w_down, stream, FusedMlpWork.new(64, 128, torch.bfloat16, DEVICE),
                         change.get("config", TOY_CONFIG))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the whole grid at Llama-3-8B's shapes, and a CUDA graph")
@pytest.mark.parametrize("prefetch", [0, 1024])
def test_llama_shapes_fit_at_once_and_replay_from_a_cuda_graph(prefetch):
    config = {**DEFAULT_CONFIG, "PREFETCH": prefetch}
    if prefetch and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("bulk L2 prefetches need sm_90")
    operands = _operands(1, k=4096, inter=14336, n=4096)
    work = FusedMlpWork.new(4096, 14336, torch.bfloat16, DEVICE)
    assert fits_at_once(*operands[:2], EPS, *operands[2:], work, config)
    _check_same(operands, config, work)
    x, sumsq, w_gate_up, w_down, stream = operands
    start = stream.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, sumsq_out = fused_decode_mlp(x, sumsq, EPS, w_gate_up, w_down, stream, work, config)
    stream.copy_(start)
    graph.replay()
    expected_stream = start.clone()
    expected_out, expected_sumsq = _two_launches(x, sumsq, w_gate_up, w_down, expected_stream, config)
    torch.cuda.synchronize()
    assert torch.equal(out, expected_out) and torch.equal(sumsq_out, expected_sumsq)
    assert torch.equal(stream, expected_stream) and not work.gave_up() and int(work.barrier[0]) == 0
