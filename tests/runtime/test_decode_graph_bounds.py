"""Decode CUDA graphs at context bounds under max_model_len (SITS_DECODE_GRAPH_BOUNDS=1): which bounds a batch size
gets (`decode_splits.graph_context_bounds`), which graph a step replays (`DecodeGraphs.graph_key`), and an engine
whose short contexts replay the graphs of their own bounds gives the greedy tokens of graphs at max_model_len alone.

The engine tests run the graphs' static buffers: captured on a GPU, eagerly under Triton's interpreter on a CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from sits.kernels import attention_decode, decode_splits  # noqa: E402
from sits.kernels.decode_splits import graph_context_bounds, plan_decode_splits  # noqa: E402
from sits.runtime.attention.triton import GRAPH_BOUNDS_ENV, TritonAttentionBackend  # noqa: E402
from sits.runtime.engine.cuda_graphs import DecodeGraphs  # noqa: E402

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
H200_SMS = 132


def test_a_splitting_batch_gets_a_graph_per_distinct_plan_up_to_the_width():
    """Llama-3-8B's 8 KV heads on an H200 at max_model_len 131,072: batches 1 to 16 split their contexts and get
    4,096, 16,384, 65,536 and the width, each bound a launch of its own; batch 24 fills the GPU with one split a
    sequence and keeps the width alone, as does a width under the first bound."""
    for batch in (1, 2, 4, 8, 16):
        bounds = graph_context_bounds(batch, 8, 131072, H200_SMS)
        assert bounds == [4096, 16384, 65536, 131072], batch
        plans = [plan_decode_splits(batch, 8, bound, H200_SMS) for bound in bounds]
        assert len({(plan.num_splits, plan.key) for plan in plans}) == len(bounds)
        assert [plan.split_bucket for plan in plans] == sorted(plan.split_bucket for plan in plans)
    assert graph_context_bounds(24, 8, 131072, H200_SMS) == [131072]
    assert graph_context_bounds(1, 8, 2176, H200_SMS) == [2176]
    # at batch 1 a 2,048-token context under the 4,096 bound takes 256-token splits, not the 131,072 bound's 2,048
    assert plan_decode_splits(1, 8, 4096, H200_SMS).split_bucket == 256
    assert plan_decode_splits(1, 8, 131072, H200_SMS).split_bucket == 2048


def test_a_bound_whose_plan_repeats_the_next_ones_gets_no_graph(monkeypatch):
    """With the first bound at 64 tokens, 64 and 128 plan the same launch at batch 1 (one 128-token split each:
    the granule), so only 128 is kept of the two."""
    monkeypatch.setattr(decode_splits, "GRAPH_BOUND_BASE", 64)
    monkeypatch.setattr(decode_splits, "GRAPH_BOUND_FACTOR", 2)
    monkeypatch.setattr(decode_splits, "MIN_TOKENS_PER_SPLIT", 128)
    monkeypatch.delenv(decode_splits.SPLIT_TOKENS_ENV, raising=False)
    assert plan_decode_splits(1, 2, 64, 16).key == plan_decode_splits(1, 2, 128, 16).key
    bounds = graph_context_bounds(1, 2, 1024, 16)
    assert 64 not in bounds and bounds[0] == 128 and bounds[-1] == 1024


def test_a_step_replays_the_smallest_bound_that_holds_its_longest_context():
    caches = [(torch.zeros(4, 16, 2, 32), torch.zeros(4, 16, 2, 32))]
    graphs = DecodeGraphs(torch.nn.Identity(), caches, [1, 2, 4], max_model_len=1000, block_size=16, capture=False,
                          bounds_for=lambda size, width: [100, 300, 5000] if size < 4 else [])
    assert graphs.bounds == {1: [112, 304, 1008], 2: [112, 304, 1008], 4: [1008]}  # whole blocks; the width kept
    assert graphs.graph_key(1, 50) == (1, 112)
    assert graphs.graph_key(2, 112) == (2, 112)
    assert graphs.graph_key(2, 113) == (2, 304)
    assert graphs.graph_key(2, 1008) == (2, 1008)
    assert graphs.graph_key(3, 40) == (4, 1008)
    plain = DecodeGraphs(torch.nn.Identity(), caches, [1, 2], max_model_len=1000, block_size=16, capture=False)
    assert plain.bounds == {1: [1008], 2: [1008]} and plain.graph_key(1, 20) == (1, 1008)


def test_the_back_end_bounds_graphs_only_when_switched_on(monkeypatch):
    monkeypatch.delenv(GRAPH_BOUNDS_ENV, raising=False)
    assert TritonAttentionBackend().decode_graph_bounds(1, 131072, 8, DEVICE) == [131072]  # off by default
    monkeypatch.setenv(GRAPH_BOUNDS_ENV, "1")
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: H200_SMS)
    assert TritonAttentionBackend().decode_graph_bounds(1, 131072, 8, DEVICE) == [4096, 16384, 65536, 131072]
    monkeypatch.setenv(GRAPH_BOUNDS_ENV, "0")
    assert TritonAttentionBackend().decode_graph_bounds(1, 131072, 8, DEVICE) == [131072]


@pytest.mark.skipif(DEVICE.type == "cpu" and not attention_decode.is_interpreter(), reason="needs the interpreter")
def test_short_contexts_replay_their_own_bounds_and_give_the_same_tokens(monkeypatch):
    """A 1,024-token width with bounds from 256 tokens, doubling (64-token splits, 16 multiprocessors, so batches
    of 1 to 4 split): the steps over a 300-token context replay the 512 bound's graphs, those over the shorter
    ones the 256 bound's, and every request gets the tokens of graphs at the width alone."""
    from tests.runtime.test_triton_backend import prompt
    from tests.runtime.test_triton_split_counters import graph_engine, greedy_tokens, long_context_model

    monkeypatch.setattr(decode_splits, "MIN_TOKENS_PER_SPLIT", 64)
    monkeypatch.setattr(decode_splits, "GRAPH_BOUND_BASE", 256)
    monkeypatch.setattr(decode_splits, "GRAPH_BOUND_FACTOR", 2)
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 16)
    monkeypatch.delenv(decode_splits.SPLIT_TOKENS_ENV, raising=False)
    requests = [("x", prompt(6, 300), 4), ("y", prompt(7, 20), 3), ("z", prompt(8, 129), 6)]
    results, replayed = {}, {}
    for switch in ("0", "1"):
        monkeypatch.setenv(GRAPH_BOUNDS_ENV, switch)
        engine = graph_engine(long_context_model(), max_model_len=1024, num_blocks=80, max_batched=1024)
        replayed[switch] = _record_graph_keys(engine.runner.decode_graphs)
        results[switch] = greedy_tokens(engine, requests)
    assert results["1"] == results["0"] and sorted(len(t) for t in results["1"].values()) == [3, 4, 6]
    assert {bound for _, _, bound in replayed["0"]} == {1024}
    assert {bound for _, _, bound in replayed["1"]} == {256, 512}  # x's steps (over 300 tokens), then z's alone
    assert all(longest <= bound and (bound == 256 or longest > bound // 2) for longest, _, bound in replayed["1"])


def _record_graph_keys(graphs: DecodeGraphs) -> list[tuple[int, int, int]]:
    """A list that gets (longest context, batch size, bound) of each graph `graphs` replays from now on."""
    replayed: list[tuple[int, int, int]] = []
    choose = graphs.graph_key

    def graph_key(num_seqs: int, max_seq_len: int) -> tuple[int, int]:
        key = choose(num_seqs, max_seq_len)
        replayed.append((max_seq_len, *key))
        return key

    graphs.graph_key = graph_key
    return replayed
