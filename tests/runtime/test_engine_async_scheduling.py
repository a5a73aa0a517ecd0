"""Async scheduling (EngineConfig.async_scheduling) through the real engine on the CPU.

With the switch on, a step launches step N+1 before it processes step N's tokens: N+1's decode
inputs come from N's sampled ids, and stops found in N's tokens are applied one step late. The
forward runs synchronously on a CPU, so nothing overlaps here, but every piece of bookkeeping is the
one a GPU runs. Each test runs the same requests through two engines over the same tiny random
Llama (SmolLM2's tokenizer), the switch off and on, and requires the same outputs token for token:
greedy and seeded sampling, n > 1, logprobs, penalties, stop strings and stop token ids, max_tokens,
max_model_len, chunked prefill, preemption and aborts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import pytest
import torch

from sits.runtime.commands.engine_args import add_engine_arguments, engine_config_from_args
from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import FinishReason, RequestOutput, SamplingParams
from sits.runtime.engine.runner import ModelRunner
from sits.runtime.engine.sequence import PENDING_TOKEN_ID
from sits.runtime.models.loading import LoadedModel
from sits.runtime.parallel.config import ParallelConfig

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker",
    "Q: What is 12 times 12?\nA:",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(tiny) -> list[list[int]]:
    return [tiny.tokenizer.encode(p) for p in PROMPTS]


class CountingRunner(ModelRunner):
    """The engine's runner, recording how many tokens each step computed for each sequence, and how
    many of its input tokens were still pending (taken from the previous step's sampled ids)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.computed: dict[str, int] = {}
        self.pending_inputs = 0

    def launch(self, scheduler_output):
        for scheduled in scheduler_output.scheduled:
            self.computed[scheduled.seq_id] = self.computed.get(scheduled.seq_id, 0) + scheduled.num_new_tokens
            self.pending_inputs += scheduled.token_ids.count(PENDING_TOKEN_ID)
        return super().launch(scheduler_output)


def make_engine(loaded: LoadedModel, async_scheduling: bool, *, max_model_len=256, block_size=8, num_blocks=96,
                max_batched=512, max_seqs=16) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_batched),
        async_scheduling=async_scheduling,
    )
    return LLMEngine.from_loaded(loaded, config, runner_factory=CountingRunner)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        abort_after: dict[str, int] | None = None, max_steps: int = 2000) -> dict[str, list[RequestOutput]]:
    """Every snapshot of every request, in order; `abort_after` aborts a request after that many steps."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    snapshots: dict[str, list[RequestOutput]] = {request_id: [] for request_id in requests}
    for step in range(1, max_steps + 1):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            snapshots[output.request_id].append(output)
        for request_id, when in (abort_after or {}).items():
            if when == step:
                for final in engine.abort_request(request_id):
                    snapshots[final.request_id].append(final)
    assert not engine.has_unfinished_requests(), "requests did not finish"
    return snapshots


def final_view(snapshots: list[RequestOutput]) -> list[dict]:
    """What a client keeps of a request: each completion's final fields, and its streamed deltas."""
    final = snapshots[-1]
    assert final.finished and all(not s.finished for s in snapshots[:-1])
    views = []
    for completion in final.outputs:
        deltas = [s.outputs[completion.index] for s in snapshots]
        views.append({
            "token_ids": completion.token_ids, "text": completion.text,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            "logprobs": completion.logprobs, "cumulative_logprob": completion.cumulative_logprob,
            "streamed_text": "".join(d.text_delta for d in deltas),
            "streamed_tokens": [t for d in deltas for t in d.token_ids_delta],
        })
        assert views[-1]["streamed_text"] == completion.text
        assert views[-1]["streamed_tokens"] == completion.token_ids
    return views


def assert_same_outputs(sync: dict[str, list[RequestOutput]], overlapped: dict[str, list[RequestOutput]]) -> None:
    assert set(sync) == set(overlapped)
    for request_id in sync:
        assert final_view(overlapped[request_id]) == final_view(sync[request_id]), request_id


def both_modes(loaded: LoadedModel, requests, **engine_args):
    engines = {mode: make_engine(loaded, mode, **engine_args) for mode in (False, True)}
    outputs = {mode: run(engine, requests) for mode, engine in engines.items()}
    # The async engine really ran ahead: decode inputs came from the previous step's sampled ids.
    assert engines[False].runner.pending_inputs == 0 and engines[True].runner.pending_inputs > 0
    return engines[False], outputs[False], engines[True], outputs[True]


def test_the_switch_is_off_on_a_cpu_by_default_set_by_a_flag_and_refused_with_tensor_parallelism(tiny):
    assert not LLMEngine.from_loaded(tiny, dataclasses.replace(make_engine(tiny, False).config,
                                                               async_scheduling=None)).async_scheduling
    assert make_engine(tiny, True).async_scheduling
    config = EngineConfig(async_scheduling=True, parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="--async-scheduling"):
        config.validate()
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for flags, expected in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        assert engine_config_from_args(parser.parse_args(["--device", "cpu", *flags])).async_scheduling is expected


def test_mixed_requests_give_the_same_outputs_with_and_without_async_scheduling(tiny, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    requests = {
        "greedy": (prompts[0], greedy),
        "ignore-eos": (prompts[1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, min_tokens=20)),
        "seeded-n3": (prompts[2], SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=9, seed=7)),
        "logprobs": (prompts[3], SamplingParams(temperature=0.0, max_tokens=7, logprobs=3)),
        "min-tokens": (prompts[0], SamplingParams(temperature=0.8, top_k=20, max_tokens=10, min_tokens=6, seed=3)),
        "one-token": (prompts[1], SamplingParams(temperature=0.0, max_tokens=1)),
        "to-max-model-len": (prompts[3], SamplingParams(temperature=0.0, max_tokens=None)),
    }
    sync_engine, sync, async_engine, overlapped = both_modes(tiny, requests, max_model_len=48)
    assert_same_outputs(sync, overlapped)
    assert len(overlapped["to-max-model-len"][-1].outputs[0].token_ids) == 48 - len(prompts[3])
    # A length stop is known when the last token is scheduled: no token is computed past it.
    assert async_engine.runner.computed == sync_engine.runner.computed
    for engine in (sync_engine, async_engine):
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert async_engine.stats().num_generation_tokens == sync_engine.stats().num_generation_tokens


def test_stops_found_in_the_output_cost_at_most_one_token_of_compute(tiny, prompts):
    probe = run(make_engine(tiny, False), {"probe": (prompts[2], SamplingParams(temperature=0.0, max_tokens=16))})
    text = probe["probe"][-1].outputs[0].text
    tokens = probe["probe"][-1].outputs[0].token_ids
    stop_string = text[len(text) // 2:][:3]
    assert stop_string.strip(), text
    requests = {
        "stop-string": (prompts[2], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop_string])),
        "stop-token": (prompts[2], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[tokens[5]])),
        "penalised": (prompts[0], SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3,
                                                 frequency_penalty=0.5, stop=[stop_string])),
        "neighbour": (prompts[1], SamplingParams(temperature=0.0, max_tokens=16)),
    }
    sync_engine, sync, async_engine, overlapped = both_modes(tiny, requests)
    assert_same_outputs(sync, overlapped)
    assert overlapped["stop-string"][-1].outputs[0].stop_reason == stop_string
    assert overlapped["stop-token"][-1].outputs[0].token_ids[-1] == tokens[5]
    for request_id in ("stop-string", "stop-token"):
        extra = async_engine.runner.computed[request_id] - sync_engine.runner.computed[request_id]
        assert 0 <= extra <= 1, request_id
    assert async_engine.runner.computed["neighbour"] == sync_engine.runner.computed["neighbour"]


def test_chunked_prefill_and_preemption_give_the_same_outputs(tiny, prompts):
    # 12-token steps chunk the longer prompts; 10 blocks of 8 tokens cannot hold all of them at once.
    requests = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
                for i, p in enumerate(prompts)}
    requests["seeded"] = (prompts[0], SamplingParams(temperature=1.0, max_tokens=10, seed=11, ignore_eos=True))
    sync_engine, sync, async_engine, overlapped = both_modes(tiny, requests, max_model_len=64, num_blocks=10,
                                                             max_batched=12)
    assert_same_outputs(sync, overlapped)
    assert async_engine.stats().num_preemptions > 0 and sync_engine.stats().num_preemptions > 0
    stats = async_engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_finished == len(requests)


def test_an_abort_mid_generation_frees_everything_and_leaves_the_others_unchanged(tiny, prompts):
    requests = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
                for i, p in enumerate(prompts)}
    results = {}
    for mode in (False, True):
        engine = make_engine(tiny, mode)
        results[mode] = run(engine, requests, abort_after={"r1": 5})
        assert engine.stats().kv_blocks_used == 0 and engine.stats().num_aborted == 1
        aborted = results[mode]["r1"][-1]
        assert aborted.finished and aborted.outputs[0].finish_reason is FinishReason.ABORT
    for request_id in ("r0", "r2", "r3"):
        assert final_view(results[True][request_id]) == final_view(results[False][request_id])
    # The async engine has delivered one step fewer when the abort comes; what it delivered agrees.
    sync_tokens = results[False]["r1"][-1].outputs[0].token_ids
    async_tokens = results[True]["r1"][-1].outputs[0].token_ids
    assert 0 < len(async_tokens) <= len(sync_tokens) and sync_tokens[: len(async_tokens)] == async_tokens


def test_the_async_engine_serves_streams_with_async_scheduling(tiny, prompts):
    """Run in its own event loop (asyncio.run), so the GPU machine's pytest needs no asyncio plugin."""
    asyncio.run(_serve_streams(tiny, prompts))


async def _serve_streams(tiny, prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i) for i in range(len(prompts))]
    expected = run(make_engine(tiny, False), {f"c{i}": (p, params[i]) for i, p in enumerate(prompts)})
    engine = AsyncEngine.from_engine(make_engine(tiny, True))
    await engine.start()
    try:
        async def collect(index: int) -> list[RequestOutput]:
            return [o async for o in engine.generate(prompts[index], params[index], f"c{index}")]

        streams = await asyncio.gather(*(collect(i) for i in range(len(prompts))))
        for index, snapshots in enumerate(streams):
            assert final_view(snapshots) == final_view(expected[f"c{index}"])
        # Leaving a stream early aborts the request and frees its blocks.
        async for _ in engine.generate(prompts[2], SamplingParams(temperature=0.0, max_tokens=200), "left"):
            break
        for _ in range(500):
            if engine.stats().kv_blocks_used == 0 and engine.stats().num_requests == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().kv_blocks_used == 0 and engine.stats().num_aborted == 1
    finally:
        await engine.shutdown()


@pytest.mark.gpu
def test_on_a_gpu_async_scheduling_with_cuda_graphs_gives_the_same_tokens():
    """The GPU path: Triton back end, decode steps replayed from CUDA graphs, pinned copies and events.

    Only length stops, so both modes run the very same batches (an extra row after an EOS could
    change a bf16 GEMM's tiling for the other rows of that step).
    """
    from sits.runtime.attention.registry import select_backend
    from sits.runtime.models.config import LlamaConfig
    from sits.runtime.models.random_model import random_loaded_model

    shape = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=1024,
                        eos_token_ids=[2])
    loaded = random_loaded_model(shape, select_backend("triton", "cuda", torch.bfloat16, 128), "cuda",
                                 torch.bfloat16, seed=3)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(8.0)  # no near-ties: a wrong input token must change the output
    generator = torch.Generator().manual_seed(1)
    requests = {f"g{n}": (torch.randint(3, 4096, (n,), generator=generator).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=40 + n % 7, ignore_eos=True))
                for n in (5, 37, 130, 300)}
    requests["seeded"] = (requests["g37"][0], SamplingParams(temperature=0.9, top_k=50, max_tokens=30, seed=5))
    outputs = {}
    for mode in (False, True):
        config = EngineConfig(
            model=ModelConfig(device="cuda", dtype="bfloat16", max_model_len=512),
            cache=CacheConfig(block_size=16, num_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
            async_scheduling=mode,
        )
        engine = LLMEngine.from_loaded(loaded, config, runner_factory=CountingRunner)
        assert engine.runner.decode_graphs is not None and engine.async_scheduling is mode
        outputs[mode] = run(engine, requests)
        assert (engine.runner.pending_inputs > 0) is mode
    assert_same_outputs(outputs[False], outputs[True])
