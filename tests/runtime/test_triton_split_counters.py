"""The Triton back end's split counters: one persistent zeroed buffer per device for the decode kernel's
fused merge, grown outside CUDA-graph capture only, and passed only while FUSED_MERGE_DEFAULT is on."""

from __future__ import annotations

import pytest
import torch

from sits.runtime.attention.backend import AttentionMetadata
from sits.runtime.attention.split_counters import SplitCounters

pytest.importorskip("triton")
from sits.kernels import attention_decode, decode_splits  # noqa: E402
from sits.runtime.attention.triton import FUSED_MERGE_ENV, TritonAttentionBackend  # noqa: E402
from tests.kernels.paged import random_paged_cache  # noqa: E402

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def test_counters_grow_never_shrink_and_keep_replaced_buffers():
    counters = SplitCounters()
    assert counters.size(DEVICE) == 0
    first = counters.get(DEVICE, 4, 8)
    assert first.dtype == torch.int32 and first.numel() == 32 and first.count_nonzero() == 0
    assert counters.get(DEVICE, 1, 8) is first  # smaller batches reuse it
    grown = counters.get(DEVICE, 16, 8)
    assert grown is not first and grown.numel() == 128 and counters.size(DEVICE) == 128
    assert counters.get(DEVICE, 4, 8) is grown
    assert any(old is first for old in counters._replaced)  # graphs captured with it may still replay


def test_no_allocation_while_a_cuda_graph_is_captured(monkeypatch):
    """A capture that would need a larger buffer gets None (the two-launch merge), never a new buffer."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    counters = SplitCounters()
    assert counters.get(torch.device("cuda:0"), 4, 8) is None
    assert counters.size(torch.device("cuda:0")) == 0


def _decode_metadata(cache, max_seq_len):
    lens = cache.seq_lens.tolist()
    num = len(lens)
    return AttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=num,
        slot_mapping=torch.full((num,), -1, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.arange(num + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=cache.seq_lens, block_tables=cache.block_tables, max_query_len=1, max_seq_len=max_seq_len,
        seq_lens_list=lens, query_lens_list=[1] * num,
    )  # fmt: skip


@pytest.mark.parametrize(("env", "default", "expected"), [(None, False, False), (None, True, True), ("1", False, True),
                                                          ("0", True, False), ("off", True, False)])
def test_the_environment_overrides_the_fused_merge_default(monkeypatch, env, default, expected):
    monkeypatch.setattr(attention_decode, "FUSED_MERGE_DEFAULT", default)
    if env is None:
        monkeypatch.delenv(FUSED_MERGE_ENV, raising=False)
    else:
        monkeypatch.setenv(FUSED_MERGE_ENV, env)
    assert TritonAttentionBackend().fused_merge is expected


@pytest.mark.skipif(DEVICE.type == "cpu" and not attention_decode.is_interpreter(), reason="needs the interpreter")
def test_back_end_passes_counters_only_when_the_fused_merge_is_on(monkeypatch):
    """Decodes long enough for several splits: the same result either way (the same bits under the interpreter's one
    schedule; on a GPU each variant is tuned on its own, FUSED_MERGE being in the autotune key, and may pick another
    tile, hence another summation order: an H100 differed in the last bit on 2026-12-05. Bit for bit at one pinned
    schedule: tests/kernels/test_attention_decode_fused.py); counters allocated and zero after."""
    torch.manual_seed(3)
    cache = random_paged_cache([700, 0, 300], 2, 64, 16, torch.float16)
    q = torch.randn(3, 4, 64).to(device=DEVICE, dtype=torch.float16)
    metadata = _decode_metadata(cache, 768)
    backend = TritonAttentionBackend()
    args = (q, q, q, cache.k_cache, cache.v_cache, metadata, 0.125)
    two_launches = backend.forward(*args)
    assert backend.split_counters.size(DEVICE) == 0
    monkeypatch.setattr(attention_decode, "FUSED_MERGE_DEFAULT", True)
    fused = backend.forward(*args)
    if attention_decode.is_interpreter():
        assert torch.equal(fused, two_launches)
    else:
        torch.testing.assert_close(fused, two_launches, rtol=2.0**-9, atol=2.0**-14)
    assert backend.split_counters.size(DEVICE) == 3 * 2
    assert backend.split_counters.get(DEVICE, 3, 2).count_nonzero() == 0


@pytest.mark.skipif(DEVICE.type == "cpu" and not attention_decode.is_interpreter(), reason="needs the interpreter")
def test_engine_tokens_are_the_same_with_the_fused_merge(monkeypatch):
    """The tiny Llama through the engine and the graphs' static padded buffers (3 decodes in a bucket of 4:
    a padding row; then 2, then 1), with four 64-token splits (MIN_TOKENS_PER_SPLIT lowered to 64, which is then
    the granule too, so a 256-token model splits; 16 multiprocessors so 4 x 2 programs do): the same greedy tokens
    with the fused merge as with the merge kernel."""
    from tests.runtime.test_triton_backend import prompt, tiny_model

    monkeypatch.setattr(decode_splits, "MIN_TOKENS_PER_SPLIT", 64)
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 16)  # 4 x 2 programs still split
    loaded = tiny_model("triton")
    waves = [[("x", prompt(6, 140), 7), ("y", prompt(7, 20), 3), ("z", prompt(8, 129), 5)]]
    assert attention_decode.plan_decode_splits(4, 2, 256, 16).num_splits == 4

    def tokens(fused: bool) -> dict[str, list[int]]:
        monkeypatch.setattr(attention_decode, "FUSED_MERGE_DEFAULT", fused)
        return _graph_buffer_tokens(loaded, waves[0], max_model_len=256, num_blocks=64, max_batched=512)

    assert tokens(True) == tokens(False)
    assert loaded.model.backend.split_counters.size(DEVICE) >= 3 * 2


@pytest.mark.skipif(DEVICE.type == "cpu" and not attention_decode.is_interpreter(), reason="needs the interpreter")
def test_engine_tokens_are_the_same_under_a_wide_graph_table(monkeypatch):
    """The graphs' static buffers tell decode attention that contexts reach the table's width, max_model_len.
    Under 1,024 tokens (8 splits launched of up to 128) and under 256 (4 of up to 64), each sequence's splits are
    sized from its own length (64 tokens each here), so the engine gives the same greedy tokens either way."""
    from tests.runtime.test_triton_backend import prompt

    monkeypatch.setattr(decode_splits, "MIN_TOKENS_PER_SPLIT", 64)
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 16)  # 4 x 2 programs still split
    monkeypatch.delenv(decode_splits.SPLIT_TOKENS_ENV, raising=False)
    loaded = long_context_model()
    requests = [("x", prompt(6, 140), 7), ("y", prompt(7, 20), 3), ("z", prompt(8, 129), 5)]
    assert [attention_decode.plan_decode_splits(4, 2, bound, 16).num_splits for bound in (1024, 256)] == [8, 4]

    wide, tight = (_graph_buffer_tokens(loaded, requests, max_model_len=bound, num_blocks=80, max_batched=1024)
                   for bound in (1024, 256))
    assert wide == tight and sorted(len(t) for t in wide.values()) == [3, 5, 7]


def long_context_model():
    """The tiny Llama with random weights (seed 3) for contexts of up to 1,024 tokens, float16 on DEVICE, on the
    Triton back end (made now: it reads the environment's switches)."""
    from sits.runtime.models.random_model import random_loaded_model
    from tests.runtime.test_triton_backend import TINY

    loaded = random_loaded_model(TINY, TritonAttentionBackend(), "cpu", torch.float32, seed=3, max_positions=1024)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(8.0)  # sharp logits, as tiny_model's
    loaded.model.to(device=DEVICE, dtype=torch.float16)
    loaded.device, loaded.dtype = torch.device(DEVICE), torch.float16
    return loaded


def graph_engine(loaded, max_model_len: int, num_blocks: int, max_batched: int):
    """An engine over `loaded` whose decode steps run the CUDA graphs' static, padded buffers for batches 1, 2 and
    4 (captured on a GPU, eager under the interpreter), the table as wide as max_model_len needs."""
    from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from sits.runtime.engine.engine import LLMEngine

    config = EngineConfig(model=ModelConfig(device=DEVICE.type, dtype="float16", max_model_len=max_model_len),
                          cache=CacheConfig(block_size=16, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_batched),
                          enforce_eager=True)
    engine = LLMEngine.from_loaded(loaded, config)
    engine.runner.setup_cuda_graphs([1, 2, 4], max_model_len=max_model_len, capture=torch.cuda.is_available())
    return engine


def greedy_tokens(engine, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    """Greedy tokens per request id of (id, prompt, tokens) requests, all added at once, run to the end."""
    from tests.runtime.test_triton_backend import greedy

    results: dict[str, list[int]] = {}
    for request_id, ids, count in requests:
        engine.add_request(request_id, ids, greedy(count))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    return results


def _graph_buffer_tokens(loaded, requests: list[tuple[str, list[int], int]], max_model_len: int, num_blocks: int,
                         max_batched: int) -> dict[str, list[int]]:
    """greedy_tokens of a graph_engine."""
    return greedy_tokens(graph_engine(loaded, max_model_len, num_blocks, max_batched), requests)
