"""Requests that do not stream text (`stream_text=False`): decoded once at the end, same text.

A non-streaming caller reads a completion's text only when it finishes, so the engine keeps its
tokens and decodes them in one call then, instead of two decodes per token per step. The text must
be exactly what streaming gives, multi-byte characters split across tokens and a trailing partial
character included, and stop strings must still end the completion at the same token.
"""

from __future__ import annotations

import random

import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.detokenizer import IncrementalDetokenizer, TextAccumulator
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import FinishReason, SamplingParams
from sits.runtime.models.embedded import embedded_gguf_path
from sits.runtime.models.gguf_cache import cached_checkpoint_dir
from sits.runtime.models.loading import LoadedModel, load_model
from sits.runtime.models.tokenizer import Tokenizer

TEXTS = ["Hello 😀 world 你好世界", "naïve café 🎉🎉 ✓ — «ok»", "日本語のテキスト 👩‍👩‍👧 done", " leading space\nand\ttabs"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_directory(cached_checkpoint_dir(embedded_gguf_path(), progress=False))


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LoadedModel:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"),
                     TorchAttentionBackend(), progress=False)
    torch.set_num_threads(threads)


def streamed_and_at_once(tokenizer, prompt: list[int], ids: list[int], skip_special: bool = True) -> tuple[str, str]:
    stream = IncrementalDetokenizer(tokenizer, prompt, skip_special)
    at_once = IncrementalDetokenizer(tokenizer, prompt, skip_special)
    return "".join(stream.add_tokens([t]) for t in ids), at_once.add_tokens_at_once(ids)


def test_decoding_at_once_gives_the_streamed_text(tokenizer):
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert streamed_and_at_once(tokenizer, prompt, ids) == (text, text)
        # Cut inside a multi-byte character: the stream held the partial character back, and so must this.
        streamed, at_once = streamed_and_at_once(tokenizer, prompt, ids[:-1])
        assert at_once == streamed and not at_once.endswith("\ufffd")
    rng = random.Random(0)
    eos = next(iter(tokenizer.eos_token_ids))
    for trial in range(30):  # random ids: byte fragments, special tokens, anything a random model emits
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))] + [eos] * (trial % 2)
        for skip in (True, False):
            streamed, at_once = streamed_and_at_once(tokenizer, prompt, ids, skip)
            assert at_once == streamed, (ids, skip)


def test_a_deferred_accumulator_releases_everything_at_the_end(tokenizer):
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    deferred = TextAccumulator(IncrementalDetokenizer(tokenizer, []), defer=True)
    assert all(deferred.add_tokens([t]) == "" for t in ids[:-1])
    assert deferred.add_tokens(ids[-1:], final=True) == TEXTS[0] == deferred.text
    # Stop strings need the text as it grows: such an accumulator decodes as it goes.
    with_stop = TextAccumulator(IncrementalDetokenizer(tokenizer, []), stop=["world"], defer=True)
    released = "".join(with_stop.add_tokens([t]) for t in ids)
    assert with_stop.stopped_by == "world" and released == with_stop.text == "Hello 😀 "


def engine(loaded: LoadedModel) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=256),
                          cache=CacheConfig(block_size=8, num_blocks=96),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    return LLMEngine.from_loaded(loaded, config)


def run(engine: LLMEngine, requests: dict, stream_text: bool) -> dict[str, list]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params, stream_text=stream_text)
    snapshots = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            snapshots[output.request_id].append(output)
    return snapshots


def mixed_requests(tiny) -> dict:
    """Greedy, n = 2 sampled, a stop string met midway, logprobs: {id: (prompt, params)}."""
    prompt = tiny.tokenizer.encode("Once upon a time, in a small village at the edge of a great forest")
    probe = run(engine(tiny), {"p": (prompt, SamplingParams(temperature=0.0, max_tokens=24))}, True)["p"][-1]
    stop = probe.outputs[0].text[len(probe.outputs[0].text) // 2:][:3]
    return {
        "plain": (prompt, SamplingParams(temperature=0.0, max_tokens=24)),
        "n2": (prompt, SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=4)),
        "stop": (prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])),
        "logprobs": (prompt, SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, skip_special_tokens=False)),
    }


def test_requests_that_do_not_stream_text_get_the_same_outputs(tiny):
    requests = mixed_requests(tiny)
    streamed = run(engine(tiny), requests, stream_text=True)
    final_only = run(engine(tiny), requests, stream_text=False)
    for request_id in requests:
        *before, last = final_only[request_id]
        assert all(c.text == c.text_delta == "" for snapshot in before for c in snapshot.outputs)
        expected = streamed[request_id][-1]
        assert len(final_only[request_id]) == len(streamed[request_id])  # a snapshot per step all the same
        for got, want in zip(last.outputs, expected.outputs, strict=True):
            assert (got.text, got.token_ids, got.finish_reason, got.stop_reason, got.logprobs) == (
                want.text, want.token_ids, want.finish_reason, want.stop_reason, want.logprobs)
            assert got.text_delta == want.text and got.text
    assert final_only["stop"][-1].outputs[0].finish_reason is FinishReason.STOP


def test_delta_only_snapshots_add_up_to_the_cumulative_ones(tiny):
    """`OutputProcessor.cumulative = False` (what `sits bench` sets): decoded snapshots carry each step's
    deltas only, no copies of the growing token ids, text and logprobs; joined, the deltas are the cumulative
    completion, stop strings, n > 1 and logprobs included, and a request that does not stream text still
    gets its whole text in the last delta."""
    requests = mixed_requests(tiny)
    for stream_text in (True, False):
        whole = run(engine(tiny), requests, stream_text=stream_text)
        deltas_engine = engine(tiny)
        deltas_engine.output_processor.cumulative = False
        deltas = run(deltas_engine, requests, stream_text=stream_text)
        for request_id in requests:
            for want in whole[request_id][-1].outputs:
                got = [c for snapshot in deltas[request_id] for c in snapshot.outputs if c.index == want.index]
                assert all(c.token_ids == [] and c.text == "" and c.logprobs is None for c in got)
                assert [t for c in got for t in c.token_ids_delta] == want.token_ids
                assert "".join(c.text_delta for c in got) == want.text
                assert (got[-1].finish_reason, got[-1].stop_reason) == (want.finish_reason, want.stop_reason)
                if want.logprobs is not None:
                    assert [lp for c in got for lp in (c.logprobs_delta or [])] == want.logprobs
    assert whole["stop"][-1].outputs[0].finish_reason is FinishReason.STOP
