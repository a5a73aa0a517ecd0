"""`--kv-cache-dtype fp8`: an e4m3 paged cache with per-layer, per-KV-head scales, end to end on CPU.

The torch back end writes and reads the fp8 cache (CPU torch quantizes and dequantizes it as bytes);
the Triton kernels read it in the interpreter. What a user relies on:
  - real text (SmolLM2-135M): teacher-forced over the float32-cache engine's greedy answers, the fp8
    cache picks the same token at nearly every position and its log-probabilities stay close, with
    static scales and better with calibrated ones;
  - the same memory holds twice the blocks of a 16-bit cache, and the start-up log says so;
  - prefix-cache hits, preemption (recompute), the host tier, speculative decoding, the padded decode
    buffers CUDA graphs replay and two tensor-parallel ranks give the same greedy tokens as a plain
    fp8 run (cached blocks are just bytes, the scales never move);
  - the torch back end stores the bytes and computes the attention `sits.kernels.reference` does;
  - bad flags and back ends that cannot read fp8 are one clear error;
  - `sits serve --kv-cache-dtype fp8` answers the openai client, and `sits bench` names the cache.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import httpx
import openai
import pytest
import torch

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.commands.engine_args import ConfigError, add_engine_arguments, engine_config_from_args
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.kv_cache_fp8 import FP8_KV_DTYPE
from sits.runtime.engine.request import SamplingParams
from sits.runtime.hardware import CPU_DEFAULTS
from sits.runtime.models.presets import preset_config
from sits.runtime.models.random_model import random_loaded_model
from tests.support.services import free_port, started

TINY = preset_config("tiny")  # 2 layers, 4 heads / 2 KV heads of 16, vocabulary 512
BLOCK_SIZE = 8
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
             "Give me a tip for learning to cook."]
ANSWER_TOKENS = 32


class NoFp8Backend(TorchAttentionBackend):
    """A back end that does not declare an fp8 cache (as one written for interface 1.1)."""

    name = "no-fp8"
    fp8_kv_cache = False


def tiny_model(backend=None, dtype=torch.float32, device="cpu"):
    loaded = random_loaded_model(TINY, backend or TorchAttentionBackend(), "cpu", torch.float32, seed=3)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(8.0)  # sharp logits: a greedy tie cannot hide a wrong cache
    loaded.model.to(device=device, dtype=dtype)
    loaded.device, loaded.dtype = torch.device(device), dtype
    return loaded


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def engine_for(loaded, kv_cache_dtype="fp8", *, num_blocks=None, kv_cache_gb=0.01, scales="static",
               max_batched=256, prefix_caching=True, host_gb=0.0, speculative=None, dtype="float32",
               max_model_len=128, device="cpu") -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(device=device, dtype=dtype, max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, kv_cache_gb=kv_cache_gb,
                          kv_cache_dtype=kv_cache_dtype, kv_cache_scales=scales,
                          enable_prefix_caching=prefix_caching, host_kv_cache_gb=host_gb),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched),
        speculative=speculative,
    )
    config.validate()
    return LLMEngine.from_loaded(loaded, config)


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab_size, (length,), generator=generator).tolist()


def greedy(tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, **extra)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], int]], min_tokens: bool = True) -> dict[str, list[int]]:
    """Greedy tokens of every request ({id: (prompt, tokens)}), all added at once, run to the end
    (EOS masked until `tokens` unless min_tokens is False: speculation waits for min_tokens)."""
    for request_id, (ids, tokens) in requests.items():
        params = greedy(tokens) if min_tokens else SamplingParams(temperature=0.0, max_tokens=tokens)
        engine.add_request(request_id, ids, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return done


# -- flags and validation ------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sits generate", exit_on_error=False)
    add_engine_arguments(parser)
    return parser.parse_args(["--device", "cpu", *argv])


def test_the_flags_reach_the_cache_config_and_fp8_e4m3_is_fp8():
    config = engine_config_from_args(parse("--kv-cache-dtype", "fp8_e4m3", "--kv-cache-scales", "calibrate"),
                                     CPU_DEFAULTS)
    assert (config.cache.kv_cache_dtype, config.cache.kv_cache_scales, config.cache.fp8) == ("fp8", "calibrate", True)
    default = engine_config_from_args(parse(), CPU_DEFAULTS)
    assert (default.cache.kv_cache_dtype, default.cache.kv_cache_scales, default.cache.fp8) == ("auto", "static", False)


def test_bad_values_are_one_clear_error():
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'int4'"):
        parse("--kv-cache-dtype", "int4")
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, got 'fp16'"):
        CacheConfig(kv_cache_dtype="fp16").validate()
    with pytest.raises(ConfigError, match="--kv-cache-scales calibrate applies to an fp8 cache only"):
        engine_config_from_args(parse("--kv-cache-scales", "calibrate"), CPU_DEFAULTS)
    with pytest.raises(ConfigError, match="--kv-cache-scales calibrate does not run with --tensor-parallel-size"):
        engine_config_from_args(parse("--kv-cache-dtype", "fp8", "--kv-cache-scales", "calibrate",
                                      "--tensor-parallel-size", "2"), CPU_DEFAULTS)


def test_a_back_end_that_cannot_read_fp8_is_refused_by_name():
    with pytest.raises(ConfigError, match="the no-fp8 attention back end does not read an fp8 cache"):
        engine_for(tiny_model(NoFp8Backend()))


def test_sits_generate_with_a_bad_cache_dtype_exits_2_with_one_line(capsys):
    from sits.runtime import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--kv-cache-dtype", "fp4", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "invalid choice: 'fp4'" in err and "Traceback" not in err


def test_sits_bench_runs_with_an_fp8_cache_and_says_so(capsys):
    from sits.runtime.cli import main

    code = main(["bench", "--config", "tiny", "--batch", "2", "--input-len", "12", "--output-len", "4", "--device", "cpu",
                 "--peer", "none", "--log-level", "warning", "--kv-cache-dtype", "fp8"])
    assert code == 0
    assert "| SITS float32, fp8 KV cache (static scales), torch attention, eager |" in capsys.readouterr().out


# -- memory ----------------------------------------------------------------------------------------


def test_the_same_memory_holds_twice_the_blocks_of_bfloat16_and_the_log_says_so(caplog):
    loaded = tiny_model(dtype=torch.bfloat16)
    bf16 = engine_for(loaded, "auto", dtype="bfloat16", kv_cache_gb=1 / 256)
    with caplog.at_level(logging.INFO, logger="sits.runtime.engine.kv_cache_fp8"):
        fp8 = engine_for(loaded, "fp8", dtype="bfloat16", kv_cache_gb=1 / 256)
    assert fp8.kv_cache.num_blocks == 2 * bf16.kv_cache.num_blocks
    k_cache, v_cache = fp8.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == FP8_KV_DTYPE
    assert k_cache.untyped_storage().nbytes() == bf16.runner.kv_caches[0][0].untyped_storage().nbytes()  # same bytes
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: fp8")]
    assert len(lines) == 1 and lines[0].startswith(
        f"KV cache: fp8 e4m3 (static per-head scales 1.0), 2x the blocks of bfloat16: {fp8.kv_cache.num_blocks} "
        f"blocks x {BLOCK_SIZE} tokens = {fp8.kv_cache.num_blocks * BLOCK_SIZE} tokens"), lines


# -- accuracy on real text -------------------------------------------------------------------------


def answer_logprobs(engine: LLMEngine, prompts: list[list[int]], answers: list[list[int]]):
    """Teacher-forced over prompt + answer: per prompt, (ranks, logprobs) of the answer's tokens [len(answer)].

    The prompt runs in chunks of at most 48 tokens (the engine's step budget), so most positions attend
    over K/V an earlier step wrote to the cache."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    results = []
    for index, (ids, answer) in enumerate(zip(prompts, answers, strict=True)):
        engine.add_request(f"tf{index}", ids + answer, params)
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
        entries = final.prompt_logprobs[len(ids):]
        results.append((torch.tensor([e.rank for e in entries]), torch.tensor([e.logprob for e in entries])))
    return results


@pytest.fixture(scope="module")
def smollm2_answers(smollm2):
    """SmolLM2's chat prompts and the float32-cache engine's greedy answers, with its teacher-forced logprobs."""
    reference = engine_for(smollm2, "auto", num_blocks=128, max_batched=48, max_model_len=256)
    tokenizer = reference.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                add_special_tokens=False) for q in QUESTIONS]
    answers = run(reference, {str(i): (ids, ANSWER_TOKENS) for i, ids in enumerate(prompts)})
    answers_in_order = [answers[str(i)] for i in range(len(prompts))]
    return prompts, answers_in_order, answer_logprobs(reference, prompts, answers_in_order)


@pytest.mark.parametrize(("scales", "min_agreement", "max_mean_error"), [("static", 0.9, 0.1), ("calibrate", 0.9, 0.1)])
def test_smollm2_with_an_fp8_cache_agrees_with_the_float32_cache(smollm2, smollm2_answers, scales, min_agreement,
                                                                 max_mean_error):
    prompts, answers, reference = smollm2_answers
    fp8 = engine_for(smollm2, "fp8", scales=scales, num_blocks=128, max_batched=48, max_model_len=256)
    measured = answer_logprobs(fp8, prompts, answers)
    ranks = torch.cat([r for r, _ in measured])
    errors = torch.cat([(lp - ref_lp).abs() for (_, lp), (_, ref_lp) in zip(measured, reference, strict=True)])
    agreement = float((ranks == 1).float().mean())
    print(f"\nfp8 cache ({scales} scales) vs float32 cache, SmolLM2 teacher-forced over {len(ranks)} tokens: "
          f"top-1 agreement {agreement:.1%}, |Δ logprob| mean {errors.mean():.4f} max {errors.max():.4f}")
    assert agreement >= min_agreement
    assert float(errors.mean()) <= max_mean_error


# -- cache features over fp8 blocks -----------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_fp8(tiny):
    """Greedy tokens of a prompt run alone on a roomy fp8 engine with no prefix caching (the expectation)."""
    engine = engine_for(tiny, num_blocks=96, prefix_caching=False)

    def expect(ids: list[int], tokens: int, min_tokens: bool = True) -> list[int]:
        return run(engine, {"alone": (ids, tokens)}, min_tokens)["alone"]

    return expect


def test_a_prefix_hit_on_fp8_blocks_gives_the_tokens_of_a_cold_run(tiny, plain_fp8):
    shared = prompt(10, 40)  # 5 full blocks
    first, second = shared + prompt(11, 5), shared + prompt(12, 9)
    engine = engine_for(tiny, num_blocks=96)
    assert run(engine, {"first": (first, 12)})["first"] == plain_fp8(first, 12)
    hits_before = engine.stats().prefix_cache_hits
    assert run(engine, {"second": (second, 12)})["second"] == plain_fp8(second, 12)
    assert engine.stats().prefix_cache_hits - hits_before == 40


def test_preemption_recomputes_fp8_blocks_to_the_same_tokens(tiny, plain_fp8):
    prompts = {f"r{i}": (prompt(20 + i, 30 + 3 * i), 24) for i in range(4)}
    engine = engine_for(tiny, num_blocks=14, max_batched=16, max_model_len=64)  # 14 blocks: not the four at once
    outputs = run(engine, prompts)
    assert engine.stats().num_preemptions > 0
    assert outputs == {rid: plain_fp8(ids, tokens) for rid, (ids, tokens) in prompts.items()}


def test_fp8_blocks_go_to_the_host_tier_and_come_back_as_the_same_bytes(tiny, plain_fp8):
    long_prompt, filler = prompt(30, 41), prompt(31, 86)
    fp8_block_bytes = 2 * TINY.num_hidden_layers * BLOCK_SIZE * TINY.num_key_value_heads * TINY.head_dim  # 1 byte each
    engine = engine_for(tiny, num_blocks=12, max_model_len=96, host_gb=64 * fp8_block_bytes / (1 << 30))
    tier = engine.runner.host_tier
    assert tier is not None and tier.num_blocks == 64 and tier.buffer.dtype == torch.uint8
    expected = plain_fp8(long_prompt, 10)
    assert run(engine, {"first": (long_prompt, 10)})["first"] == expected
    run(engine, {"filler": (filler, 10)})  # takes all 12 blocks: the first prompt's go to the host
    before = engine.stats()
    assert run(engine, {"again": (long_prompt, 10)})["again"] == expected
    after = engine.stats()
    assert after.prefix_cache_host_hits - before.prefix_cache_host_hits >= 4 * BLOCK_SIZE
    assert after.host_kv is not None and after.host_kv.onload_blocks > 0


def test_speculative_decoding_over_an_fp8_cache_keeps_greedy_tokens(tiny, plain_fp8):
    long_prompt = prompt(40, 100)  # a fifth of the vocabulary: 1-gram drafts find matches
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    engine = engine_for(tiny, num_blocks=96, speculative=spec)
    assert run(engine, {"spec": (long_prompt, 20)}, min_tokens=False)["spec"] == plain_fp8(long_prompt, 20, False)
    spec_stats = engine.stats().spec_decode
    assert spec_stats is not None and spec_stats.num_draft_tokens > 0


# -- the Triton kernels over an fp8 cache (the interpreter on CPU) -------------------------------------


def test_triton_kernels_reading_an_fp8_cache_pick_the_torch_back_ends_tokens():
    """fp8 cache: a mixed step (prefill beside decodes), a chunked prompt and a prefix hit through
    Triton's decode and prefill kernels give the torch back end's greedy tokens: a float16 model, in the
    interpreter on CPU, on a GPU with the fused RoPE + fp8 write and CUDA graphs."""
    pytest.importorskip("triton")
    from sits.runtime.attention.triton import TritonAttentionBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"

    shared = prompt(50, 24)
    requests = {"a": (shared + prompt(51, 3), 6), "b": (prompt(52, 20), 6), "c": (shared + prompt(53, 11), 6)}
    tokens = {}
    for name, backend in (("torch", TorchAttentionBackend()), ("triton", TritonAttentionBackend())):
        loaded = tiny_model(backend, dtype=torch.float16, device=device)
        engine = engine_for(loaded, num_blocks=48, max_batched=24, dtype="float16", scales="calibrate", device=device)
        tokens[name] = run(engine, {"a": requests["a"]}) | run(engine, {k: requests[k] for k in ("b", "c")})
        assert engine.stats().prefix_cache_hits >= 24
    assert tokens["triton"] == tokens["torch"]


# -- sits serve ------------------------------------------------------------------------------------


def test_sits_serve_with_an_fp8_cache_answers_the_openai_client(tiny_llama_dir):
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--served-model-name", "tiny-fp8", "--port", str(port), "--max-model-len", "128",
            "--kv-cache-gb", "0.01", "--kv-cache-dtype", "fp8", "--kv-cache-scales", "calibrate"]
    with started(argv, port, timeout_s=120, log_name="serve.log") as server:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(model="tiny-fp8", prompt="Hello", max_tokens=4)
        assert completion.usage.completion_tokens >= 1 and completion.choices[0].finish_reason in ("stop", "length")
        log = (server.workdir / "serve.log").read_text(errors="replace")
    assert "KV cache: fp8 e4m3 (calibrated per-head scales" in log and "4x the blocks of float32" in log
    assert "Traceback" not in log


# -- tensor parallelism ----------------------------------------------------------------------------


def tp_generate(checkpoint_dir, tensor_parallel_size: int) -> list[list[int]]:
    """Greedy tokens of two prompts on the tiny Llama checkpoint with an fp8 cache, on CPU ranks."""
    from sits.runtime.parallel.config import ParallelConfig

    config = EngineConfig(
        model=ModelConfig(model=str(checkpoint_dir), device="cpu", dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=4, num_blocks=64, kv_cache_dtype="fp8"),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8),  # chunked beside decodes
        attention_backend="torch", parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size))
    engine = LLMEngine.from_config(config, progress=False)
    try:
        assert engine.runner.kv_caches[0][0].dtype == FP8_KV_DTYPE
        done = run(engine, {"r0": ([1, 17, 42, 99, 7, 250, 3, 64, 12, 4001, 77], 12), "r1": ([5, 200, 11], 12)})
    finally:
        engine.shutdown()
    return [done["r0"], done["r1"]]


@pytest.mark.timeout(180)
def test_two_ranks_with_fp8_shards_of_their_kv_heads_generate_what_one_process_does(tiny_llama_dir):
    assert tp_generate(tiny_llama_dir, 2) == tp_generate(tiny_llama_dir, 1)


def test_decode_steps_through_the_padded_graph_buffers_read_the_same_fp8_cache(tiny, plain_fp8):
    """The buffers CUDA graphs replay (run eagerly on CPU) take the cache with its fixed scale tensors."""
    engine = engine_for(tiny, num_blocks=96, prefix_caching=False)
    runner = engine.runner
    runner.setup_cuda_graphs([1, 2, 4, 8], 128, capture=False)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.kv_caches is runner.kv_caches
    assert runner.kv_caches[1].k_scale.data_ptr() == runner.kv_scales.k[1].data_ptr()  # a view of the owner's
    replays = []
    original_run = graphs.run
    graphs.run = lambda model_input: replays.append(model_input.metadata.num_decodes) or original_run(model_input)
    requests = {f"g{i}": (prompt(60 + i, 9 + 4 * i), 10) for i in range(3)}
    assert run(engine, requests) == {rid: plain_fp8(ids, tokens) for rid, (ids, tokens) in requests.items()}
    assert replays and max(replays) == 3  # the decode steps went through the padded buffers


# -- the torch back end against the kernels' references --------------------------------------------


def test_the_torch_back_end_writes_and_reads_fp8_as_the_kernel_references_do():
    """One step of a prefill chunk after a cached prefix and a decode, over a random fp8 cache with
    per-head scales: the same stored bytes and the same attention output as `sits.kernels.reference`."""
    from sits.kernels.reference import (
        paged_decode_attention_reference,
        paged_prefill_attention_reference,
        rope_and_cache_write_reference,
    )
    from sits.runtime.engine.model_input import build_model_input
    from sits.runtime.engine.scheduler_output import ScheduledSequence
    from sits.runtime.engine.sequence import Sequence
    from sits.runtime.models.rotary import build_cos_sin_cache

    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block = 4, 2, 32, 8
    k_scale, v_scale = torch.tensor([0.02, 0.5]), torch.tensor([0.01, 0.003])  # heads far apart
    shape = (16, block, kv_heads, head_dim)
    caches = [(torch.randn(shape, generator=generator) * 0.1 / scale[:, None]).to(FP8_KV_DTYPE)
              for scale in (k_scale, v_scale)]
    prefill = Sequence("p", "t", 0, list(range(20)), greedy(1), 1, 0.0)
    decode = Sequence("d", "t", 0, list(range(31)), greedy(1), 1, 0.0)
    metadata = build_model_input([ScheduledSequence(prefill, list(range(15, 20)), 15, [3, 5, 7], True),
                                  ScheduledSequence(decode, [30], 30, [0, 1, 2, 4], True)], block, "cpu").metadata
    q = torch.randn(6, heads, head_dim, generator=generator)
    k = torch.randn(6, kv_heads, head_dim, generator=generator) * 3
    v = torch.randn(6, kv_heads, head_dim, generator=generator) * 0.2
    positions = torch.tensor([15, 16, 17, 18, 19, 30])
    cos_sin = build_cos_sin_cache(head_dim, 64, 10000.0, None)
    ours = [cache.clone() for cache in caches]
    backend = TorchAttentionBackend()
    q_rot, k_rot = backend.rope_and_cache_write(q, k, v, positions, cos_sin, *ours, metadata.slot_mapping,
                                                k_scale=k_scale, v_scale=v_scale)
    out = backend.forward(q_rot, k_rot, v, *ours, metadata, head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)

    expected_caches = [cache.view(torch.uint8).clone().view(FP8_KV_DTYPE) for cache in caches]
    rope_and_cache_write_reference(q, k, v, positions, cos_sin, *expected_caches, metadata.slot_mapping,
                                   k_scale, v_scale)
    for mine, theirs in zip(ours, expected_caches, strict=True):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    tables, lens = metadata.block_tables, metadata.seq_lens
    expected = torch.cat([
        paged_prefill_attention_reference(q_rot[:5], *ours, metadata.query_start_loc[:2], lens[:1], tables[:1],
                                          head_dim**-0.5, **scales),
        paged_decode_attention_reference(q_rot[5:], *ours, tables[1:], lens[1:], head_dim**-0.5, **scales)])
    torch.testing.assert_close(out[:6], expected, atol=2e-5, rtol=1e-5)
    dequantized_wrongly = paged_decode_attention_reference(q_rot[5:], *ours, tables[1:], lens[1:], head_dim**-0.5)
    assert not torch.allclose(dequantized_wrongly, expected[5:], atol=1e-2)  # the scales matter here
