"""The Triton attention back end against the torch reference, through the real engine.

On a CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)
on a tiny float16 random Llama; on a GPU they run natively. Both back ends get the same seeded
weights and must produce the same greedy tokens in every batch shape the scheduler builds: prefill
and decode mixed in one step, prompts chunked across steps, prompts that hit the prefix cache, and
decode steps through the static padded buffers the CUDA graphs replay.
"""

from __future__ import annotations

import pytest
import torch

from sits.runtime.attention.backend import INTERFACE_VERSION, AttentionBackend
from sits.runtime.attention.registry import (
    BackendUnavailableError,
    BackendVersionError,
    load_external_backend,
    register_backend,
    select_backend,
    unregister_backend,
)
from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.random_model import random_loaded_model

pytest.importorskip("triton")
from sits.runtime.attention.triton import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                   eos_token_ids=[2])
BLOCK_SIZE = 16


def tiny_model(backend_name: str):
    """The tiny Llama in float16 with `backend_name`; the same seed gives both back ends the same weights."""
    backend = TritonAttentionBackend() if backend_name == "triton" else TorchAttentionBackend()
    loaded = random_loaded_model(TINY, backend, "cpu", torch.float32, seed=3)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(8.0)  # sharper logits: greedy ties cannot hide a wrong kernel
    loaded.model.to(device=DEVICE, dtype=torch.float16)
    loaded.device, loaded.dtype = torch.device(DEVICE), torch.float16
    return loaded


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(name) for name in ("torch", "triton")}


def engine_for(loaded, *, max_batched=512, num_blocks=48, enforce_eager=True, activation_dtype="auto") -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(device=DEVICE, dtype="float16", max_model_len=128, activation_dtype=activation_dtype),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched),
        enforce_eager=enforce_eager,
    )
    return LLMEngine.from_loaded(loaded, config)


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY.vocab_size, (length,), generator=generator).tolist()


def run_schedule(engine: LLMEngine, waves: list[list[tuple[str, list[int], int]]], steps_between: int = 2):
    """Add each wave of (id, prompt, tokens) requests, stepping a little between waves; tokens per id."""
    results: dict[str, list[int]] = {}
    for wave in waves:
        for request_id, ids, tokens in wave:
            engine.add_request(request_id, ids, greedy(tokens))
        for _ in range(steps_between):
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
    return results


# Two prompts start; two more arrive while the first decode (mixed prefill + decode steps); the last
# repeats a long prefix of the first (a prefix-cache hit: prefill after cached blocks).
SHARED = prompt(1, 40)
WAVES = [
    [("a", SHARED, 10), ("b", prompt(2, 7), 12)],
    [("c", prompt(3, 23), 8), ("d", prompt(4, 1), 9)],
    [("e", SHARED[:35] + prompt(5, 6), 8)],
]


@pytest.mark.parametrize("max_batched", [512, 16], ids=["whole-prompts", "chunked-prefill"])
def test_triton_back_end_matches_torch_through_the_engine(models, max_batched):
    expected = run_schedule(engine_for(models["torch"], max_batched=max_batched), WAVES)
    engine = engine_for(models["triton"], max_batched=max_batched)
    got = run_schedule(engine, WAVES)
    assert got == expected
    assert engine.stats().prefix_cache_hits > 0, "the last prompt should reuse the first one's blocks"


def test_float32_activations_match_torch_through_the_engine(models):
    """--activation-dtype float32 (float16 weights and KV cache): the Triton kernels (norms writing float32, RoPE
    writing the float16 cache from float32 k / v, attention over float32 q with float32 out) pick the torch back
    end's tokens in every step shape, and the steps really ran in float32."""
    expected = run_schedule(engine_for(models["torch"], max_batched=16, activation_dtype="float32"), WAVES)
    engine = engine_for(models["triton"], max_batched=16, activation_dtype="float32")
    assert models["triton"].model.activation_dtype == torch.float32
    got = run_schedule(engine, WAVES)
    assert got == expected
    engine_for(models["triton"])  # the next engine over this model runs float16 activations again
    assert models["triton"].model.activation_dtype is None


def test_float32_activations_on_the_small_m_kernels_through_the_engine(models, tmp_path, monkeypatch):
    """--activation-dtype float32 with a small-M table covering every projection at every bucket (a fresh Triton
    model: installing changes it): the steps of at most 16 tokens run the direct, split-K and SiLU·mul kernels on
    float32 rows (two float16 terms a tile) and pick the tokens of the torch back end's mixed_linear steps."""
    from sits.kernels import gemm_small_m, gemm_small_m_splitk
    from sits.runtime.models.small_m_linear import SMALL_M_ENV, install_small_m_gemm, installed_table
    from tests.runtime.test_small_m_linear import _table_file

    expected = run_schedule(engine_for(models["torch"], max_batched=16, activation_dtype="float32"), WAVES)
    loaded = tiny_model("triton")
    monkeypatch.setenv(SMALL_M_ENV, _table_file(tmp_path, loaded.model, splitk=frozenset({8})))
    engine = engine_for(loaded, max_batched=16, activation_dtype="float32")
    assert install_small_m_gemm(loaded.model, installed_table("cpu")) == 4 * TINY.num_hidden_layers
    rows = []
    for module in (gemm_small_m, gemm_small_m_splitk):
        real = module.launch

        def recording(kernel, x, w, out, *args, _real=real, _name=module.__name__, **meta):
            rows.append((_name.rsplit(".", 1)[1], x.dtype, out.dtype))
            return _real(kernel, x, w, out, *args, **meta)

        monkeypatch.setattr(module, "launch", recording)
    assert run_schedule(engine, WAVES) == expected
    assert {name for name, _, _ in rows} == {"gemm_small_m", "gemm_small_m_splitk"}
    assert {(x, out) for _, x, out in rows} == {(torch.float32, torch.float32)}


def test_padded_decode_buffers_give_the_same_tokens(models):
    """The CUDA-graph path's static buffers (3 decodes padded to a bucket of 4), run eagerly on CPU."""
    waves = [[("x", prompt(6, 9), 6), ("y", prompt(7, 17), 6), ("z", prompt(8, 30), 6)]]
    expected = run_schedule(engine_for(models["triton"]), waves)
    engine = engine_for(models["triton"])
    engine.runner.setup_cuda_graphs([1, 2, 4], max_model_len=128, capture=torch.cuda.is_available())
    assert run_schedule(engine, waves) == expected


@pytest.mark.parametrize(("max_batched", "sizes"), [(16, [8, 16]), (512, [8, 16, 32])],
                         ids=["chunked-every-step", "whole-prompts-some-eager"])
def test_piecewise_graphs_give_the_same_tokens(models, max_batched, sizes):
    """Steps with prompt tokens through the piecewise graphs (the pieces between attention calls, attention
    run between them over the static buffers, rows padded to a bucket), against the eager forward. On a
    CPU the pieces run eagerly over the same buffers and holes; on a GPU they are captured and replayed.
    With 16-token steps every step fits a bucket; with whole prompts the larger steps run eagerly."""
    expected = run_schedule(engine_for(models["triton"], max_batched=max_batched), WAVES)
    engine = engine_for(models["triton"], max_batched=max_batched)
    engine.runner.setup_piecewise_graphs(sizes, capture=torch.cuda.is_available())
    graphs = engine.runner.piecewise_graphs
    assert graphs is not None and graphs.largest == sizes[-1]
    if torch.cuda.is_available():
        assert len(graphs.holes) == TINY.num_hidden_layers
        assert all(len(p.graphs) == TINY.num_hidden_layers + 1 for p in graphs.pieces.values())
    replays: list[tuple[int, int]] = []
    original_run = graphs.run
    graphs.run = lambda mi: replays.append((mi.metadata.num_prefill_tokens, mi.num_tokens)) or original_run(mi)
    assert run_schedule(engine, WAVES) == expected
    mixed = [(p, t) for p, t in replays if p and t > p]
    assert mixed, "no step with prompt tokens beside decodes went through the pieces"
    assert any(t not in sizes for _, t in replays), "no step was padded to its bucket"
    assert all(t <= sizes[-1] for _, t in replays)


def test_piecewise_graphs_check_their_replay_against_the_eager_forward(models, caplog):
    """Before serving, the replay of the smallest and the largest bucket is compared with the eager forward
    over a prompt that fills it; pieces that attend wrongly (here: the attention between them skipped, so
    the next piece reads stale rows) turn the graphs off with a warning instead of serving wrong tokens."""
    from sits.runtime.engine.engine_setup import PIECEWISE_TOLERANCE, _verify_piecewise_graphs

    engine = engine_for(models["triton"])
    runner = engine.runner
    runner.setup_piecewise_graphs([8, 16, 32], capture=torch.cuda.is_available())
    errors = runner.piecewise_graphs.verify(TINY.vocab_size)
    assert set(errors) == {8, 32} and all(e <= 1e-2 for e in errors.values()), errors
    assert all(float(c[0][:2].abs().sum()) == 0.0 for c in runner.kv_caches)  # its K/V zeroed again
    broken = runner.piecewise_graphs
    broken.attend = lambda hole, metadata, num_tokens: None
    assert min(broken.verify(TINY.vocab_size).values()) > PIECEWISE_TOLERANCE
    with caplog.at_level("WARNING", logger="sits.runtime.engine.engine_setup"):
        _verify_piecewise_graphs(runner)
    assert runner.piecewise_graphs is None and "piecewise CUDA graphs off" in caplog.text
    expected = run_schedule(engine_for(models["triton"]), WAVES)
    assert run_schedule(engine, WAVES) == expected  # eagerly again


def test_a_failed_piecewise_capture_leaves_the_steps_eager(models, caplog):
    """Engine setup with piecewise graphs: on a GPU they capture and pass the replay check; where capturing
    fails (on a CPU there is no CUDA to capture with) the engine logs why and runs those steps eagerly."""
    from sits.runtime.engine.engine_setup import _setup_piecewise_graphs

    engine = engine_for(models["triton"])
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    with caplog.at_level("INFO", logger="sits.runtime.engine.engine_setup"):
        _setup_piecewise_graphs(engine.runner, engine.runner.model.backend, config)
    if torch.cuda.is_available():
        assert engine.runner.piecewise_graphs is not None and "replay against the eager forward" in caplog.text
    else:
        assert engine.runner.piecewise_graphs is None
        assert "piecewise CUDA graphs off: capturing them failed" in caplog.text
    expected = run_schedule(engine_for(models["triton"]), WAVES)
    assert run_schedule(engine, WAVES) == expected


def test_piecewise_buckets_and_their_default_size():
    from sits.runtime.engine.piecewise_graphs import piecewise_token_sizes

    assert piecewise_token_sizes(0) == []
    assert piecewise_token_sizes(20) == [8, 16, 20]
    sizes = piecewise_token_sizes(1024)
    assert sizes[:4] == [8, 16, 32, 64] and sizes[-1] == 1024 and 512 in sizes and 640 in sizes
    assert all(b > a for a, b in zip(sizes, sizes[1:], strict=False))
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                                    max_prefill_tokens_with_decodes=768))
    assert config.piecewise_max_tokens == 2048  # at least the steps whose launches the host would pace
    config.scheduler.max_num_seqs, config.scheduler.max_prefill_tokens_with_decodes = 2048, 1024
    assert config.piecewise_max_tokens == 3072  # the largest step beside a full decode batch
    config.scheduler.max_prefill_tokens_with_decodes = 0
    assert config.piecewise_max_tokens == 2048
    config.scheduler.max_num_batched_tokens = 300
    assert config.piecewise_max_tokens == 300
    config.piecewise_graph_max_tokens = 0
    assert config.piecewise_max_tokens == 0
    config.piecewise_graph_max_tokens = -1
    with pytest.raises(ConfigError, match="--piecewise-graph-max-tokens"):
        config.validate()


# -- the registry: declarations, auto selection, interface versions ---------------------------------


def test_triton_declares_what_it_supports_and_auto_keeps_the_interpreter_off():
    assert TritonAttentionBackend.supports_cuda_graphs and not TorchAttentionBackend.supports_cuda_graphs
    assert "head_dim 16/32/64/128/256" in TritonAttentionBackend.describe()
    assert TritonAttentionBackend.unsupported_reason(torch.device("cpu"), torch.float16, 96) is not None
    if not torch.cuda.is_available():
        assert type(select_backend("auto", "cpu", torch.float16, 64)) is TorchAttentionBackend
        assert type(select_backend("triton", "cpu", torch.float16, 64)) is TritonAttentionBackend
        with pytest.raises(BackendUnavailableError, match="bfloat16 arithmetic is broken"):
            select_backend("triton", "cpu", torch.bfloat16, 64)


class _FutureBackend(TorchAttentionBackend):
    name = "test-future"
    interface_version = "2.0"


class _CompatibleBackend(TorchAttentionBackend):
    name = "test-compatible"
    interface_version = INTERFACE_VERSION.split(".")[0] + ".0"
    priority = -1


def test_an_external_back_end_of_another_major_version_is_refused_clearly():
    with pytest.raises(BackendVersionError, match="interface 2.0.*this runtime implements.*upgrade SITS"):
        register_backend(_FutureBackend)
    with pytest.raises(BackendUnavailableError, match="'test-future' is not available .*interface 2.0"):
        select_backend("test-future", "cpu", torch.float32, 64)
    # the entry-point path: a plug-in that hands back its class is registered after the same check
    load_external_backend("test-compatible", lambda: _CompatibleBackend)
    try:
        assert isinstance(select_backend("test-compatible", "cpu", torch.float32, 64), AttentionBackend)
    finally:
        unregister_backend(_CompatibleBackend.name)
