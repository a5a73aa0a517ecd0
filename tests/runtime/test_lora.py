"""LoRA adapters through LLMEngine: each row of a batch runs its own adapter (or none), and equals the
base model with that adapter merged into its weights (transformers on W + scale · B · A): greedy
tokens identical, each chosen token's logprob within float32 tolerance. Prefix caching never hands
one adapter's KV to another (or to the base model). Bad adapters and flags are one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.errors import InvalidRequestError
from sits.runtime.engine.prefix_hash import extend_block_hashes
from sits.runtime.engine.request import RequestOutput, SamplingParams
from sits.runtime.lora.config import LoraConfig, LoraConfigError, LoraModule, parse_lora_module
from tests.runtime.lora_helpers import hf_greedy, merged_hf_model, write_peft_adapter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 6
LOGPROB_TOLERANCE = 2e-4
PROMPTS = ["The three primary colors are", "Once upon a time, in a small village at the edge of a forest,"]


@pytest.fixture(scope="module", autouse=True)
def hooks_come_off(tiny):
    """Each engine's adapters replace the last one's on the module's tiny model; the last come off at the end."""
    yield
    manager = getattr(tiny.model, "lora_manager", None)
    if manager is not None:
        manager.detach()


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, Path]:
    """Two adapters over the tiny model: "alpha" on every projection (rank 8), "beta" on q/v and
    down_proj only, rank 4 with rsLoRA (its other slices stay zero)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": write_peft_adapter(root / "alpha", tiny.config, rank=8, alpha=16, seed=1),
        "beta": write_peft_adapter(root / "beta", tiny.config, rank=4, alpha=8, seed=2, use_rslora=True,
                                   targets=("q_proj", "v_proj", "down_proj")),
    }


def lora_config(adapters: dict[str, Path], **overrides) -> EngineConfig:
    modules = [LoraModule(name, str(path)) for name, path in adapters.items()]
    return EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=8, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        lora=LoraConfig(enable_lora=True, modules=modules, **overrides),
    )


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, RequestOutput]:
    """Add every request before the first step (so they share steps), then step to the end."""
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, prompt, greedy(), lora=lora)
    final: dict[str, RequestOutput] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished_requests()
    return final


def assert_matches(output: RequestOutput, reference: tuple[list[int], list[float]], what: str) -> None:
    tokens, logprobs = reference
    completion = output.outputs[0]
    assert completion.token_ids == tokens, what
    ours = [entry.logprob for entry in completion.logprobs]
    assert ours == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), what


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters, tiny):
    """name (None: base) -> greedy tokens and logprobs of each prompt under the merged weights."""
    prompts = [tiny.tokenizer.encode(p) for p in PROMPTS]
    result = {}
    for name in (None, "alpha", "beta"):
        model = merged_hf_model(tiny_llama_dir, adapters[name] if name else None)
        result[name] = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    return prompts, result


def test_one_adapter_matches_its_merged_weights(tiny, adapters, references):
    prompts, expected = references
    engine = LLMEngine.from_loaded(tiny, lora_config({"alpha": adapters["alpha"]}))
    outputs = run(engine, {f"r{i}": (ids, "alpha") for i, ids in enumerate(prompts)})
    for i in range(len(prompts)):
        assert_matches(outputs[f"r{i}"], expected["alpha"][i], f"prompt {i}")
    assert expected["alpha"][0][0] != expected[None][0][0], "the adapter should change the output"


def test_mixed_batch_runs_each_row_with_its_own_adapter(tiny, adapters, references):
    prompts, expected = references
    engine = LLMEngine.from_loaded(tiny, lora_config(adapters))
    requests = {f"{name or 'base'}-{i}": (ids, name) for name in (None, "alpha", "beta")
                for i, ids in enumerate(prompts)}
    outputs = run(engine, requests)  # six sequences in every step: base, alpha and beta rows mixed
    assert engine.stats().num_steps == NEW_TOKENS
    for request_id, (_, name) in requests.items():
        assert_matches(outputs[request_id], expected[name][int(request_id[-1])], request_id)
    assert len({tuple(expected[name][0][0]) for name in (None, "alpha", "beta")}) == 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_mixes_adapters_within_a_step(tiny, adapters, references, async_scheduling):
    prompts, expected = references
    config = lora_config(adapters)
    config.scheduler.max_num_batched_tokens = 10  # prompts run in chunks beside other rows' decodes
    config.async_scheduling = async_scheduling
    engine = LLMEngine.from_loaded(tiny, config)
    requests = {f"{name or 'base'}-{i}": (ids, name) for i, ids in enumerate(prompts)
                for name in ("beta", None, "alpha")}
    outputs = run(engine, requests)
    for request_id, (_, name) in requests.items():
        assert_matches(outputs[request_id], expected[name][int(request_id[-1])], request_id)


def test_prefix_cache_is_never_shared_across_adapters(tiny, adapters, references):
    prompts, expected = references
    prompt = prompts[1]  # 16 tokens: the first block of 8 can be a hit (the last token always runs)
    engine = LLMEngine.from_loaded(tiny, lora_config(adapters))
    assert_matches(run(engine, {"base": (prompt, None)})["base"], expected[None][1], "base")
    assert_matches(run(engine, {"alpha": (prompt, "alpha")})["alpha"], expected["alpha"][1], "alpha after base")
    assert_matches(run(engine, {"beta": (prompt, "beta")})["beta"], expected["beta"][1], "beta after alpha")
    assert engine.stats().prefix_cache_hits == 0  # same tokens, three adapters: no block shared
    again = run(engine, {"again": (prompt, "alpha")})["again"]
    assert_matches(again, expected["alpha"][1], "alpha again")
    assert engine.stats().prefix_cache_hits == again.metrics.num_cached_prompt_tokens == 8  # same adapter: a hit


def test_the_adapter_keys_the_prefix_hash_chain():
    tokens = list(range(16))

    def chain(salt=None, lora=None):
        hashes: list[bytes] = []
        extend_block_hashes(hashes, tokens, block_size=8, num_full_blocks=2, cache_salt=salt, lora_name=lora)
        return hashes

    base, alpha = chain(), chain(lora="alpha")
    assert base[0] != alpha[0] and base[1] != alpha[1]  # the first block's key carries down the chain
    assert len({alpha[0], chain(lora="beta")[0], chain(salt="lora:alpha")[0], chain("t", "alpha")[0]}) == 4
    assert chain(salt="t") == chain(salt="t") and alpha == chain(lora="alpha")


def test_smollm2_adapter_matches_its_merged_weights(smollm2, smollm2_checkpoint_dir, tmp_path):
    adapter = write_peft_adapter(tmp_path / "smol", smollm2.config, rank=8, alpha=16, seed=3, b_std=0.05)
    engine = LLMEngine.from_loaded(smollm2, lora_config({"smol": adapter}))
    try:
        prompt = smollm2.tokenizer.encode(PROMPTS[0])
        outputs = run(engine, {"lora": (prompt, "smol"), "base": (prompt, None)})
    finally:
        engine.lora.detach()  # the session's SmolLM2 goes back to the base model alone
    assert_matches(outputs["lora"], hf_greedy(merged_hf_model(smollm2_checkpoint_dir, adapter), prompt, NEW_TOKENS),
                   "adapter")
    assert outputs["base"].outputs[0].token_ids != outputs["lora"].outputs[0].token_ids
    assert not any(m._forward_hooks for m in smollm2.model.modules())


def test_without_lora_the_model_is_untouched(tiny, adapters):
    engine = LLMEngine.from_loaded(tiny, lora_config(adapters))
    engine.lora.detach()
    plain = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=128),
                         cache=CacheConfig(block_size=8, num_blocks=32))
    engine = LLMEngine.from_loaded(tiny, plain)
    assert engine.lora is None and engine.runner.lora is None
    assert not any(m._forward_hooks for m in tiny.model.modules())
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        engine.add_request("r", [1, 2, 3], greedy(), lora="alpha")


def test_unknown_adapter_is_an_invalid_request(tiny, adapters):
    engine = LLMEngine.from_loaded(tiny, lora_config(adapters))
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'gamma'"):
        engine.add_request("r", [1, 2, 3], greedy(), lora="gamma")
    assert not engine.has_unfinished_requests()


def test_lora_modules_values():
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "base"}') == LoraModule(
        "sql", "/a", "base")
    for bad in ("sql", "=/a", '{"name": "sql"}', '{"name": 1, "path": "/a"}', "{not json"):
        with pytest.raises(LoraConfigError, match="--lora-modules"):
            parse_lora_module(bad)


@pytest.mark.parametrize(("lora", "overrides", "message"), [
    (LoraConfig(modules=[LoraModule("a", "/x")]), {}, "--lora-modules needs --enable-lora"),
    (LoraConfig(enable_lora=True, modules=[LoraModule("a", "/x"), LoraModule("b", "/y")], max_loras=1), {},
     "--max-loras 1 is less than the 2 adapters"),
    (LoraConfig(enable_lora=True, modules=[LoraModule("a", "/x"), LoraModule("a", "/y")]), {}, "names 'a' twice"),
    (LoraConfig(enable_lora=True, max_lora_rank=0), {}, "--max-lora-rank must be positive"),
    (LoraConfig(enable_lora=True), {"quantization": "fp8"}, "--enable-lora does not run with --quantization fp8"),
])
def test_bad_lora_flags_are_config_errors(lora, overrides, message):
    config = EngineConfig(model=ModelConfig(device="cpu", **overrides), lora=lora)
    with pytest.raises(ConfigError, match=message):
        config.validate()


def test_lora_with_tensor_parallelism_is_a_config_error():
    config = EngineConfig(lora=LoraConfig(enable_lora=True))
    config.parallel.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="--enable-lora does not run with --tensor-parallel-size"):
        config.validate()


def _bad_adapters(root: Path, config) -> list[tuple[Path, str]]:
    wide = dataclasses.replace(config, hidden_size=config.hidden_size * 2)  # an adapter for another model
    return [
        (root / "missing", "no such adapter directory"),
        (write_peft_adapter(root / "rank", config, rank=32, alpha=32), "rank 32, above --max-lora-rank 16"),
        (write_peft_adapter(root / "fc", config, targets=("q_proj", "fc1")), "unknown target module 'fc1'"),
        (write_peft_adapter(root / "emb", config, extra_config={"target_modules": ["q_proj", "embed_tokens"]}),
         "embeddings or lm_head are not supported"),
        (write_peft_adapter(root / "emb2", config, targets=("q_proj",), extra_tensors={
            "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}), "embeddings or lm_head are not supported"),
        (write_peft_adapter(root / "shape", wide, targets=("q_proj",)), "does not match|needs"),
    ]


def test_bad_adapters_are_one_line_startup_errors(tiny, tmp_path):
    if getattr(tiny.model, "lora_manager", None) is not None:
        tiny.model.lora_manager.detach()
    for path, message in _bad_adapters(tmp_path, tiny.config):
        with pytest.raises(ConfigError, match=message) as error:
            LLMEngine.from_loaded(tiny, lora_config({"bad": path}))
        assert str(error.value).startswith(f"--lora-modules bad={path}") and "\n" not in str(error.value)
    assert not any(m._forward_hooks for m in tiny.model.modules())  # refused before the model was touched
    with pytest.raises(ConfigError, match="the adapter has the base model's name"):
        LLMEngine.from_loaded(tiny, lora_config({tiny.name: tmp_path / "rank"}))
