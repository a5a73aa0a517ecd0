"""Decode attention's fused merge (split_counters=...): bit for bit the two-launch path.

The interpreter runs programs one after another, in grid order (split innermost), so the "last split to
finish" is normally the highest non-empty split. Some tests force other orders by permuting the split
index the interpreter hands each program (those tests are the interpreter's only). What only a GPU shows is the
memory ordering between programs that really run at once (the release / acquire around the counter): the
`gpu`-marked tests at the end. On a GPU both paths run one fixed split-kernel schedule (GPU_SCHEDULE).
"""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from sits.kernels import attention_decode
from sits.kernels.attention_decode import paged_decode_attention, paged_decode_attention_reference
from sits.kernels.decode_splits import SPLIT_TOKENS_ENV
from sits.kernels.last_arrival import last_arrival
from tests.kernels.helpers import DEVICE, ON_GPU, assert_close, poisoned, randn
from tests.kernels.paged import random_paged_cache

# (query heads, KV heads, tokens per page): every GQA group size, each page size with two of them.
HEAD_LAYOUTS = [pytest.param(2, 2, 16, id="gqa1-page16"), pytest.param(8, 2, 64, id="gqa4-page64"),
                pytest.param(8, 1, 16, id="gqa8-page16"), pytest.param(6, 2, 64, id="gqa3-page64")]  # fmt: skip
# Ragged: padding rows (0), a context inside one 128-token split (1, 37), exact split ends (128, 256).
SEQ_LENS = [300, 0, 37, 128, 1, 256, 0, 129]


@pytest.fixture
def nan_empty(monkeypatch) -> list[torch.Tensor]:
    """torch.empty filled with NaN while the test runs: partials nobody wrote can never look right. Returns the
    floating-point tensors so allocated, in order."""
    empty = torch.empty
    allocated: list[torch.Tensor] = []

    def poisoned_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        if tensor.is_floating_point():
            allocated.append(tensor.fill_(float("nan")))
        return tensor

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    return allocated


def _split_order(monkeypatch, order: str) -> None:
    """Run each (KV head, sequence)'s splits in `order`: "reversed" or "shuffled" (seeded)."""
    set_grid_idx = interpreter.InterpreterBuilder.set_grid_idx
    rng = random.Random(5)
    perms: dict[int, list[int]] = {}

    def permuted(self, x, y, z):
        count = self.grid_dim[2]
        if order == "reversed":
            return set_grid_idx(self, x, y, count - 1 - z)
        perm = perms.setdefault(count, rng.sample(range(count), count))
        return set_grid_idx(self, x, y, perm[z])

    monkeypatch.setattr(interpreter.InterpreterBuilder, "set_grid_idx", permuted)


# On a GPU both variants run this split-kernel schedule: autotuned, each (FUSED_MERGE is in the autotune key) may
# pick another BLOCK_N, hence another summation order inside a split. The interpreter has one schedule.
GPU_SCHEDULE = (64, 4, 4)


def _both(cache, q, splits, counters, **kwargs):
    """(two-launch output, fused output) for one launch shape, at GPU_SCHEDULE on a GPU unless kwargs name one;
    the counters must end at zero."""
    if ON_GPU:
        kwargs.setdefault("schedule", GPU_SCHEDULE)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    two = paged_decode_attention(*args, out=poisoned(*q.shape, dtype=q.dtype), num_splits=splits, **kwargs)
    fused = paged_decode_attention(*args, out=poisoned(*q.shape, dtype=q.dtype), num_splits=splits,
                                   split_counters=counters, **kwargs)
    assert not fused.isnan().any(), "the fused merge left output rows unwritten"
    assert counters.count_nonzero() == 0, f"counters not reset: {counters.tolist()}"
    return two, fused


@pytest.mark.parametrize("num_q_heads,num_kv_heads,block_size", HEAD_LAYOUTS)
def test_fused_merge_is_bit_identical(nan_empty, num_q_heads, num_kv_heads, block_size):
    """fp16, several batches and split counts, the same counters reused by every call."""
    torch.manual_seed(num_q_heads * 10 + num_kv_heads + block_size)
    counters = torch.zeros(len(SEQ_LENS) * num_kv_heads + 3, dtype=torch.int32, device=DEVICE)
    for batch in (1, 3, len(SEQ_LENS)):
        cache = random_paged_cache(SEQ_LENS[:batch], num_kv_heads, 64, block_size, torch.float16)
        q = randn(batch, num_q_heads, 64, dtype=torch.float16)
        expected = paged_decode_attention_reference(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                                    cache.seq_lens, 0.125)
        for splits in (2, 3, 4):
            two, fused = _both(cache, q, splits, counters)
            assert torch.equal(two, fused), f"batch {batch}, {splits} splits"
            assert_close(fused, expected, torch.float16, scale=2.0)
            for row, length in enumerate(SEQ_LENS[:batch]):
                if length == 0:
                    assert fused[row].abs().max() == 0


def test_fused_merge_many_splits_and_head_dim_128(nan_empty):
    """Eight splits (the merge's BLOCK_S 8), head_dim 128, a row shorter than one split beside."""
    torch.manual_seed(11)
    cache = random_paged_cache([1000, 5, 0], 2, 128, 16, torch.float16)
    q = randn(3, 8, 128, dtype=torch.float16)
    counters = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        two, fused = _both(cache, q, 8, counters)
        assert torch.equal(two, fused)


def test_fused_merge_under_a_wide_bound(nan_empty, monkeypatch):
    """max_seq_len far past every context (a CUDA graph's table width): many launched splits (chosen ones on 132
    multiprocessors, and 16), a few filled per row, each row's count of them its own; the fused merge waits for
    exactly those, bit for bit the two launches."""
    monkeypatch.delenv(SPLIT_TOKENS_ENV, raising=False)
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 132)
    torch.manual_seed(13)
    cache = random_paged_cache([300, 0, 37, 129], 2, 64, 16, torch.float16)
    q = randn(4, 8, 64, dtype=torch.float16)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    expected = paged_decode_attention_reference(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens,
                                                0.125)
    for splits in (None, 16):
        two, fused = _both(cache, q, splits, counters, max_seq_len=1 << 15)
        assert torch.equal(two, fused)
        assert_close(fused, expected, torch.float16, scale=2.0)


def test_each_row_writes_the_partials_of_the_splits_its_length_fills(nan_empty, monkeypatch):
    """Which splits write partials, read off the log-sum-exp buffer (allocated NaN): told 32,768 tokens on 132
    multiprocessors, a launch of 4 rows x 2 KV heads runs 64 splits of up to 512 tokens; a 300-token row fills
    two of 256 (the least a split keeps), a 37-token row one, a padding row none, a 2,000-token row eight."""
    monkeypatch.delenv(SPLIT_TOKENS_ENV, raising=False)
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 132)
    torch.manual_seed(14)
    lengths = [300, 37, 0, 2000]
    cache = random_paged_cache(lengths, 2, 64, 16, torch.float16)
    q = randn(4, 8, 64, dtype=torch.float16)
    plan = attention_decode.plan_decode_splits(4, 2, 1 << 15, 132)
    assert (plan.num_splits, plan.tokens_per_split) == (64, 512)
    paged_decode_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125,
                           out=poisoned(*q.shape, dtype=q.dtype), max_seq_len=1 << 15)
    lse = next(t for t in nan_empty if t.shape == (4, 8, plan.num_splits))
    written = [int((~lse[row, 0].isnan()).sum()) for row in range(4)]
    assert written == [2, 1, 0, 8]
    assert all((~lse[row].isnan()).sum(-1).eq(count).all() for row, count in enumerate(written))  # every head alike


def _fp8_cache(seq_lens):
    cache = random_paged_cache(seq_lens, 2, 64, 16, torch.float16)
    cache.k_cache = (cache.k_cache.float() / 0.04).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache.v_cache = (cache.v_cache.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    return cache, {"k_scale": torch.tensor([0.02, 0.05], device=DEVICE),
                   "v_scale": torch.tensor([0.03, 0.01], device=DEVICE)}


@pytest.mark.parametrize("dtype,variant", [(torch.float16, "swap_g_f"), (torch.float16, "base"),
                                           (torch.bfloat16, "swap_g_f")], ids=["fp16", "fp16-base", "bf16"])
def test_fused_merge_fp8_cache(nan_empty, dtype, variant):
    """An fp8 cache (float16 dots: no bf16 arithmetic, so bf16 queries run in the interpreter too)."""
    torch.manual_seed(12)
    cache, scales = _fp8_cache([200, 0, 50, 1])
    q = randn(4, 8, 64, dtype=dtype)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    for splits in (2, 3):
        two, fused = _both(cache, q, splits, counters, fp8_variant=variant, **scales)
        assert torch.equal(two, fused)
        assert fused[1].abs().max() == 0


@pytest.mark.skipif(ON_GPU, reason="orders the interpreter's programs; on a GPU they run at once")
@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_fused_merge_in_any_program_order(nan_empty, monkeypatch, order):
    """Splits finishing in another order than their index: the last to arrive merges, whichever it is."""
    torch.manual_seed(13)
    cache = random_paged_cache([600, 0, 130, 37], 2, 64, 16, torch.float16)
    q = randn(4, 8, 64, dtype=torch.float16)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    in_order = {splits: _both(cache, q, splits, counters)[1] for splits in (5, 3)}
    _split_order(monkeypatch, order)
    for splits in (5, 3):
        two, fused = _both(cache, q, splits, counters)
        assert torch.equal(two, fused)
        assert torch.equal(fused, in_order[splits])


@triton.jit
def _arrival_kernel(counter_ptr, winner_ptr, calls_ptr, num_valid):
    split = tl.program_id(2)
    if split < num_valid:  # the others are empty splits: they never arrive
        tl.atomic_add(calls_ptr, 1)
        if last_arrival(counter_ptr, num_valid):
            tl.atomic_add(winner_ptr + split, 1)


@pytest.mark.skipif(ON_GPU, reason="orders the interpreter's programs; on a GPU they run at once")
@pytest.mark.parametrize("order", ["reversed", "shuffled"])
@pytest.mark.parametrize("programs,num_valid", [(6, 6), (6, 4), (1, 1)])
def test_last_arrival_picks_the_last_program_to_arrive(monkeypatch, order, programs, num_valid):
    """Exactly one program wins, the last non-empty one in the (forced) order, and the counter ends at 0."""
    _split_order(monkeypatch, order)
    ran: list[int] = []
    set_grid_idx = interpreter.InterpreterBuilder.set_grid_idx

    def record(self, x, y, z):
        set_grid_idx(self, x, y, z)
        ran.append(self.grid_idx[2])

    monkeypatch.setattr(interpreter.InterpreterBuilder, "set_grid_idx", record)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    winner = torch.zeros(programs, dtype=torch.int32, device=DEVICE)
    calls = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # twice: the reset counter works again
        winner.zero_()
        ran.clear()
        _arrival_kernel[(1, 1, programs)](counter, winner, calls, num_valid)
        last = [split for split in ran if split < num_valid][-1]
        assert winner.tolist() == [int(split == last) for split in range(programs)]
        assert counter.item() == 0
    assert calls.item() == 2 * num_valid


def test_single_split_ignores_the_counters():
    torch.manual_seed(14)
    cache = random_paged_cache([40, 7], 2, 64, 16, torch.float16)
    q = randn(2, 4, 64, dtype=torch.float16)
    counters = torch.full((4,), 7, dtype=torch.int32, device=DEVICE)  # not even zero: never read
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.125)
    out = paged_decode_attention(*args, num_splits=1, split_counters=counters)
    assert torch.equal(out, paged_decode_attention(*args, num_splits=1))
    assert counters.tolist() == [7] * 4


def test_bad_split_counters_raise_value_error():
    cache = random_paged_cache([300, 20, 5], 2, 64, 16, torch.float16)
    q = randn(3, 4, 64, dtype=torch.float16)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 0.1)
    bad = {
        "must have dtype": torch.zeros(6, dtype=torch.int64, device=DEVICE),
        "needs num_seqs x num_kv_heads = 6 entries": torch.zeros(5, dtype=torch.int32, device=DEVICE),
        "must be on": torch.zeros(6, dtype=torch.int32, device="meta"),
        "must be contiguous": torch.zeros(12, dtype=torch.int32, device=DEVICE)[::2],
        "split_counters must have 1 dimension": torch.zeros(2, 6, dtype=torch.int32, device=DEVICE),
    }
    for message, counters in bad.items():
        with pytest.raises(ValueError, match=message):
            paged_decode_attention(*args, num_splits=2, split_counters=counters)
    with pytest.raises(ValueError, match="split_counters must be a torch.Tensor"):
        paged_decode_attention(*args, num_splits=2, split_counters=[0] * 6)


GPU_SEQ_LENS = [8191, 1, 2048, 0, 5000, 33, 128, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_fused_merge_bit_identical_gpu(kv_dtype, batch):
    """On the GPU the splits run at once: the counter's ordering is what makes this pass, every time."""
    torch.manual_seed(batch)
    cache = random_paged_cache(GPU_SEQ_LENS[:batch], 8, 128, 16, torch.bfloat16)
    scales = {}
    if kv_dtype == torch.float8_e4m3fn:
        cache.k_cache = (cache.k_cache.float() / 0.01).clamp(-448, 448).to(kv_dtype)
        cache.v_cache = (cache.v_cache.float() / 0.02).clamp(-448, 448).to(kv_dtype)
        scales = {"k_scale": torch.full((8,), 0.01, device=DEVICE), "v_scale": torch.full((8,), 0.02, device=DEVICE)}
    q = randn(batch, 32, 128, dtype=torch.bfloat16)
    counters = torch.zeros(batch * 8, dtype=torch.int32, device=DEVICE)
    # One schedule for both (GPU_SCHEDULE, which _both pins): autotuned, each variant (FUSED_MERGE is in the autotune key) may pick another BLOCK_N,
    # and with it another summation order inside a split (the 2026-12-03 bench run saw that on the bf16 cache).
    for splits in (None, 2, 16, 64):
        for _ in range(20):
            two, fused = _both(cache, q, splits, counters, **scales)
            assert torch.equal(two, fused), f"{splits} splits"


@pytest.mark.gpu
def test_fused_merge_replayed_in_a_cuda_graph():
    """A captured launch replayed many times: the counters come back to zero after each replay."""
    assert ON_GPU
    torch.manual_seed(21)
    cache = random_paged_cache([3000, 0, 700], 8, 128, 16, torch.bfloat16)
    q = randn(3, 32, 128, dtype=torch.bfloat16)
    counters = torch.zeros(3 * 8, dtype=torch.int32, device=DEVICE)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.seq_lens, 128**-0.5)
    expected = paged_decode_attention(*args, num_splits=16, schedule=GPU_SCHEDULE)
    out = torch.empty_like(q)
    paged_decode_attention(*args, out=out, num_splits=16, split_counters=counters, schedule=GPU_SCHEDULE)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):
            paged_decode_attention(*args, out=out, num_splits=16, split_counters=counters, schedule=GPU_SCHEDULE)
    for _ in range(50):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert counters.count_nonzero() == 0
