"""The start-up pre-tune's key listing against the bucket functions the kernels launch with, and its
launches through the Triton back end on the CPU interpreter.

Every step the scheduler can build (random compositions of prefill chunks and decodes within the
limits, and the CUDA-graph decode batches) must map to a prefill bucket, a decode split plan and a
GEMM row bucket + compile class that `tuning_plan` lists; for small limits the listing is checked
exhaustively and found exact (no key it lists is unreachable). The GPU side (no autotune entry
appears after start-up) is tests/gpu/test_kernel_warmup.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from sits.kernels.attention_decode import plan_decode_splits
from sits.kernels.attention_prefill import prefill_len_bucket
from sits.kernels.decode_splits import graph_context_bounds
from sits.runtime.engine.cuda_graphs import decode_batch_sizes
from sits.runtime.engine.kernel_warmup import (
    AUTOTUNE_CACHE_ENV,
    autotune_disk_cache_wanted,
    dummy_metadata,
    enable_autotune_disk_cache,
    kernel_autotuners,
    pretune_kernels,
    quantized_layers,
    run_attention_plan,
    run_gemm_plan,
)
from sits.runtime.engine.tuning_plan import (
    KernelLimits,
    PrefillShape,
    gemm_rows_bucket,
    int_specialization,
    tuning_plan,
)


@triton.jit
def _fill_kernel(out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, 1.0, mask=offsets < n)


LIMITS = {
    "llama-3-8b on an H200": KernelLimits(8192, 256, 8192, 16, 8, 132, 150_000 * 16),
    "long context, few KV heads": KernelLimits(2048, 64, 32768, 32, 1, 132, 20_000 * 32),
    "small GPU, odd lengths": KernelLimits(1000, 48, 3000, 16, 3, 20, 400 * 16),
    "tiny": KernelLimits(96, 6, 700, 16, 2, 8, 64 * 16),
}


def _decode_key(limits: KernelLimits, num_seqs: int, max_context: int) -> tuple[bool, int, int]:
    return plan_decode_splits(num_seqs, limits.num_kv_heads, max_context, limits.num_sms).key


def _gemm_key(rows: int) -> tuple[int, int]:
    return gemm_rows_bucket(rows), int_specialization(rows)


def _random_step(rng: random.Random, limits: KernelLimits) -> tuple[list[tuple[int, int]], list[int]]:
    """A step the scheduler could build: prefill chunks (new tokens, context after them) first, then
    decodes (context), within the token budget, the sequence cap and max_model_len."""
    budget, seqs = limits.max_num_batched_tokens, rng.randint(1, limits.max_num_seqs)
    prefills, decodes = [], []
    for _ in range(seqs):
        if budget == 0:
            break
        if rng.random() < 0.3:
            chunk = rng.randint(1, min(budget, limits.max_model_len))
            prefills.append((chunk, rng.randint(chunk, limits.max_model_len)))
            budget -= chunk
        else:
            decodes.append(rng.randint(1, limits.max_model_len))
            budget -= 1
    return prefills, decodes


@pytest.mark.parametrize("name", LIMITS)
def test_every_step_the_scheduler_can_build_maps_to_a_listed_key(name):
    limits = LIMITS[name]
    plan = tuning_plan(limits)
    prefill_keys = {shape.len_bucket for shape in plan.prefill}
    decode_keys = {shape.key for shape in plan.decode}
    gemm_keys = {_gemm_key(rows) for rows in plan.gemm_rows}
    rng = random.Random(name)
    for _ in range(3000):
        prefills, decodes = _random_step(rng, limits)
        max_seq_len = max([context for _, context in prefills] + decodes)
        if prefills:
            assert prefill_len_bucket(max(chunk for chunk, _ in prefills)) in prefill_keys, prefills
        if decodes:  # the back end passes the whole step's longest context to the decode kernel
            assert _decode_key(limits, len(decodes), max_seq_len) in decode_keys, (len(decodes), max_seq_len)
        assert _gemm_key(sum(chunk for chunk, _ in prefills) + len(decodes)) in gemm_keys
    for size in decode_batch_sizes(limits.max_num_seqs):  # CUDA-graph decodes: the tables' whole width
        assert _decode_key(limits, size, limits.context_limit) in decode_keys
        # and each context bound their graphs may be captured at (SITS_DECODE_GRAPH_BOUNDS=1)
        for bound in graph_context_bounds(size, limits.num_kv_heads, limits.context_limit, limits.num_sms):
            assert _decode_key(limits, size, bound) in decode_keys, (size, bound)


@pytest.mark.parametrize("name", ["small GPU, odd lengths", "tiny"])
def test_listing_is_exact_for_small_limits(name):
    """All reachable keys, enumerated: the listing holds exactly those, and each witness reaches its key."""
    limits = LIMITS[name]
    plan = tuning_plan(limits)
    reachable_decode = {_decode_key(limits, n, context) for n in range(1, limits.max_num_seqs + 1)
                        for context in range(1, limits.context_limit + 1)}
    assert {shape.key for shape in plan.decode} == reachable_decode
    for shape in plan.decode:
        assert _decode_key(limits, shape.num_seqs, shape.max_context) == shape.key
        assert 1 <= shape.num_seqs <= limits.max_num_seqs and 1 <= shape.max_context <= limits.context_limit
    assert [s.len_bucket for s in plan.prefill] == sorted({prefill_len_bucket(q)
                                                           for q in range(1, limits.longest_chunk + 1)})
    for shape in plan.prefill:
        assert prefill_len_bucket(shape.query_len) == shape.len_bucket
        assert shape.query_len <= shape.context_len <= limits.context_limit
        assert shape.num_seqs * shape.query_len <= limits.max_num_batched_tokens
    all_rows = range(1, limits.max_num_batched_tokens + 1)
    assert {_gemm_key(rows) for rows in plan.gemm_rows} == {_gemm_key(rows) for rows in all_rows}


def test_witnesses_fit_the_cache_and_use_big_batches():
    """A decode key is tuned on the largest batch of its kind whose contexts fit in the KV cache."""
    limits = LIMITS["llama-3-8b on an H200"]
    plan = tuning_plan(limits)
    longest = next(s for s in plan.decode if s.single and s.max_context == limits.context_limit)
    assert longest.num_seqs == min(limits.max_num_seqs, limits.cache_tokens // limits.context_limit)
    short = next(s for s in plan.decode if s.key == (True, 128, 0))
    assert short.num_seqs == limits.max_num_seqs
    assert plan.prefill[-1] == PrefillShape(8192, 8192, 1, 8192)


def test_autotune_disk_cache_is_on_unless_the_user_said_otherwise():
    assert autotune_disk_cache_wanted({})
    assert autotune_disk_cache_wanted({AUTOTUNE_CACHE_ENV: "1"})
    assert not autotune_disk_cache_wanted({AUTOTUNE_CACHE_ENV: "0"})
    environ: dict[str, str] = {AUTOTUNE_CACHE_ENV: "0"}
    assert enable_autotune_disk_cache(environ) is False and environ == {AUTOTUNE_CACHE_ENV: "0"}
    environ = {}
    assert enable_autotune_disk_cache(environ) is False  # the interpreter never tunes
    names = {tuner.base_fn.__name__ for tuner in kernel_autotuners()}
    assert {"_prefill_attention_kernel", "_decode_split_kernel"} <= names
    assert any("gemm" in name for name in names)


@pytest.fixture(scope="module")
def triton_tiny(tiny_llama_dir):
    """The tiny random Llama in float16 on the Triton back end (the CPU interpreter)."""
    from sits.runtime.attention.triton import TritonAttentionBackend
    from sits.runtime.config import ModelConfig
    from sits.runtime.models.loading import load_model

    return load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float16"),
                      TritonAttentionBackend(), progress=False)


def _runner(loaded, num_blocks: int):
    from sits.runtime.engine.runner import ModelRunner
    from sits.runtime.engine.sampler import Sampler

    runner = ModelRunner(loaded.model, loaded.device, loaded.dtype, 16, Sampler((), loaded.device))
    runner.allocate_kv_cache(num_blocks)
    return runner


def test_the_plan_runs_through_the_triton_back_end_and_writes_no_cache_slot(triton_tiny):
    runner = _runner(triton_tiny, num_blocks=12)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    limits = KernelLimits(48, 4, 160, 16, runner.kv_shape.num_kv_heads, 8, 12 * 16)
    plan = tuning_plan(limits)
    assert run_attention_plan(runner, torch.float16, plan) == len(plan.prefill) + len(plan.decode)
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert pretune_kernels(runner, torch.float16, _scheduler(48, 4), 160) is None  # CPU: nothing autotunes


def test_dummy_steps_match_the_reference_back_end(triton_tiny):
    """The pre-tune's dummy launches are well-formed steps: the Triton kernels agree with the torch reference."""
    from sits.runtime.attention.torch_ref import TorchAttentionBackend

    runner = _runner(triton_tiny, num_blocks=8)
    k_cache, v_cache = runner.kv_caches[0]
    k_cache.normal_()
    v_cache.normal_()
    plan = tuning_plan(KernelLimits(32, 3, 100, 16, runner.kv_shape.num_kv_heads, 8, 8 * 16))
    for shape in (plan.prefill[-1], plan.decode[0], plan.decode[-1]):
        metadata = dummy_metadata(shape, 16, runner.num_blocks, runner.device)
        q = torch.randn(metadata.num_tokens, 4, 16, dtype=torch.float16)
        kv = torch.zeros(metadata.num_tokens, 2, 16, dtype=torch.float16)
        got = triton_tiny.model.backend.forward(q, kv, kv, k_cache, v_cache, metadata, 0.25)
        want = TorchAttentionBackend().forward(q, kv, kv, k_cache, v_cache, metadata, 0.25)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_torch_back_end_and_unquantized_models_have_nothing_to_tune(tiny):
    runner = _runner(tiny, num_blocks=4)
    plan = tuning_plan(KernelLimits(32, 4, 64, 16, 2, 8, 64))
    assert run_attention_plan(runner, torch.float32, plan) == 0
    assert quantized_layers(tiny.model) == [] and run_gemm_plan(tiny.model, torch.float32, plan.gemm_rows) == 0


def test_gemm_plan_runs_each_distinct_quantized_layer_once_per_row_count(tiny_llama_dir):
    from sits.runtime.attention.torch_ref import TorchAttentionBackend
    from sits.runtime.config import ModelConfig
    from sits.runtime.models.loading import load_model
    from sits.runtime.models.quantize import Int8Linear, quantize_model

    loaded = load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"),
                        TorchAttentionBackend(), progress=False)
    quantize_model(loaded.model, "int8")
    layers = quantized_layers(loaded.model)
    every = [module for module in loaded.model.modules() if isinstance(module, Int8Linear)]
    assert len(layers) == len({(m.in_features, m.out_features) for m in every}) < len(every)
    assert run_gemm_plan(loaded.model, torch.float32, (1, 15, 16)) == 3 * len(layers)


def _scheduler(max_num_batched_tokens: int, max_num_seqs: int):
    from sits.runtime.config import SchedulerConfig

    return SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def _zero_output(nargs):
    nargs["out_ptr"].zero_()


def _hooked_tuner(block_sizes=(16, 32)):
    """An autotuner whose configs carry a pre-launch hook, like the GEMMs' split-K configs."""
    configs = [triton.Config({"BLOCK": block}, num_warps=4, pre_hook=_zero_output) for block in block_sizes]
    return triton.autotune(configs=configs, key=["n"])(_fill_kernel)


def test_choices_triton_cannot_keep_survive_a_restart(tmp_path, monkeypatch):
    from sits.runtime.engine.tuning_records import (
        RECORD_FILE,
        load_choices,
        save_choices,
        unrecorded_by_triton,
    )

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    first = _hooked_tuner()
    assert unrecorded_by_triton([first]) == [first]
    first.cache[(64, "torch.float16")] = first.configs[1]
    first.cache[(8, "torch.float32")] = first.configs[0]
    assert save_choices([first], "GPU A") == 2

    restarted = _hooked_tuner()
    assert load_choices([restarted], "GPU A") == 2
    assert restarted.cache == {(64, "torch.float16"): restarted.configs[1], (8, "torch.float32"): restarted.configs[0]}
    assert load_choices([_hooked_tuner()], "GPU B") == 0  # another GPU: tuned afresh
    assert load_choices([_hooked_tuner((16, 64))], "GPU A") == 0  # other configs: tuned afresh

    for record in tmp_path.rglob(RECORD_FILE):
        record.write_text('[["(64,", 1]]')  # damaged: skipped, the keys are tuned again
    damaged = _hooked_tuner()
    assert load_choices([damaged], "GPU A") == 0 and damaged.cache == {}
