"""Tensor parallelism on CPU: two gloo ranks on 127.0.0.1 must generate what one process generates.

- The converter (`apply_tensor_parallel`): two spawned ranks shard small random Llamas (GQA with K/V
  heads split, tied embeddings with a vocabulary that does not divide evenly, one K/V head replicated
  on both ranks with every bias on) and run batched prefill + greedy decode; tokens equal TP=1 and
  fp32 logits agree, on both ranks.
- The executor: this test process is rank 0, as the engine's process is; it spawns one worker and
  drives the runner the engine uses with scheduler-shaped steps (a partial prefill chunk that samples
  nothing, a mixed prefill step, decodes). A killed worker makes the next step raise, never hang;
  shutdown leaves no process and no process group behind.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import queue
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ConfigError
from sits.runtime.engine.errors import EngineError
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.runner import ModelRunner
from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from sits.runtime.engine.sequence import Sequence
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.loading import build_random_model
from sits.runtime.parallel.commands import AllocateKVCache, WorkerFailedError
from sits.runtime.parallel.config import ParallelConfig
from sits.runtime.parallel.distributed import apply_nccl_env, free_port
from sits.runtime.parallel.executor import TensorParallelExecutor, _exit_without_reaping
from sits.runtime.parallel.recipe import ModelRecipe
from sits.runtime.parallel.tp import (
    TensorParallelError,
    apply_tensor_parallel,
    local_kv_cache_shape,
    supported_tensor_parallel_sizes,
)
from tests.support.model_driver import PagedKVCache, PagedSequence, run_step

SEED = 7
NEW_TOKENS = 24
BLOCK_SIZE = 4
PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64, 12], [5, 200, 11]]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
             max_position_embeddings=128, rms_norm_eps=1e-5)
CASES = {
    "gqa_kv_heads_split": LlamaConfig(vocab_size=512, num_key_value_heads=2, **SHAPE),
    "tied_embeddings_odd_vocab": LlamaConfig(vocab_size=301, num_key_value_heads=2, tie_word_embeddings=True, **SHAPE),
    "one_kv_head_replicated_with_biases": LlamaConfig(vocab_size=256, num_key_value_heads=1, attention_bias=True,
                                                      o_proj_bias=True, mlp_bias=True, **SHAPE),
}


# -- the converter, driven like the model tests drive the plain model ------------------------------


def greedy_with_logits(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], np.ndarray]:
    """Batched prefill of every prompt, then batched greedy decode.

    Returns (new tokens per prompt, logits [new_tokens, len(prompts), vocab] float32).
    """
    num_blocks = len(prompts) * -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE) + 1
    cache = PagedKVCache(model, num_blocks, BLOCK_SIZE)
    shape = local_kv_cache_shape(model, num_blocks, BLOCK_SIZE)  # this rank's K/V heads only
    cache.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in cache.caches]
    seqs = [PagedSequence(list(p)) for p in prompts]
    chunks = [(seq, len(seq.token_ids)) for seq in seqs]
    logits_per_step = []
    for _ in range(new_tokens):
        logits = run_step(model, cache, chunks)
        logits_per_step.append(logits.numpy())
        for seq, row in zip(seqs, logits, strict=True):
            seq.token_ids.append(int(row.argmax()))
        chunks = [(seq, 1) for seq in seqs]
    tokens = [seq.token_ids[len(p):] for seq, p in zip(seqs, prompts, strict=True)]
    return tokens, np.stack(logits_per_step)


def _sharded_rank_main(rank: int, world_size: int, port: int, results: multiprocessing.Queue) -> None:
    """One rank of the converter test (a spawned process): every case, sharded for this rank."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        outputs = {}
        for name, config in CASES.items():
            model = build_random_model(config, TorchAttentionBackend(), seed=SEED)
            apply_tensor_parallel(model, rank, world_size)
            outputs[name] = greedy_with_logits(model, PROMPTS, NEW_TOKENS)
        results.put((rank, outputs))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(results: multiprocessing.Queue, processes: list, timeout_s: float) -> dict:
    """One result per process; fails fast when a process dies without answering."""
    collected: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(collected) < len(processes):
        try:
            rank, payload = results.get(timeout=0.5)
        except queue.Empty:
            if time.monotonic() > deadline:
                pytest.fail(f"tensor-parallel ranks answered {sorted(collected)} within {timeout_s} s")
            if any(p.exitcode not in (None, 0) for p in processes):
                pytest.fail(f"a rank died: exit codes {[p.exitcode for p in processes]}")
            continue
        if isinstance(payload, str):
            pytest.fail(f"rank {rank} failed:\n{payload}")
        collected[rank] = payload
    return collected


@pytest.fixture(scope="module")
def two_rank_outputs() -> dict:
    """{rank: {case: (tokens, logits)}} from two spawned gloo ranks (both joined or killed here)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_sharded_rank_main, args=(rank, 2, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        return _collect(results, processes, timeout_s=90)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


@pytest.mark.timeout(150)
def test_tensor_parallel_two_ranks_generate_what_one_process_generates(two_rank_outputs):
    # One test for every case: the two ranks are spawned once (xdist would spawn them per worker).
    for case, config in CASES.items():
        model = build_random_model(config, TorchAttentionBackend(), seed=SEED)
        expected_tokens, expected_logits = greedy_with_logits(model, PROMPTS, NEW_TOKENS)
        for rank in (0, 1):
            tokens, logits = two_rank_outputs[rank][case]
            assert tokens == expected_tokens, f"{case}, rank {rank}"
            assert logits.shape == expected_logits.shape == (NEW_TOKENS, len(PROMPTS), config.vocab_size)
            np.testing.assert_allclose(logits, expected_logits, rtol=1e-4, atol=1e-5, err_msg=f"{case}, rank {rank}")
        if case != "tied_embeddings_odd_vocab":  # (a tied random model repeats its input token)
            assert len(set(expected_tokens[0])) > 1, f"{case}: the comparison needs varied tokens"


def test_tensor_parallel_size_that_does_not_divide_the_heads_is_a_clear_error():
    config = CASES["gqa_kv_heads_split"]
    assert supported_tensor_parallel_sizes(config) == [1, 2, 4]
    model = build_random_model(config, TorchAttentionBackend(), seed=SEED)
    with pytest.raises(TensorParallelError) as error:
        apply_tensor_parallel(model, 0, 3)
    message = str(error.value)
    assert "--tensor-parallel-size 3" in message
    assert "num_attention_heads (4)" in message and "num_key_value_heads (2)" in message
    assert "sizes that work for it: 1, 2, 4" in message
    assert isinstance(error.value, ConfigError)  # the CLI prints it as a one-line error
    assert model.model.layers[0].self_attn.num_heads == 4  # a refused conversion leaves the model whole

    recipe = ModelRecipe.random(config, seed=SEED, device="cpu", dtype="float32", attention_backend="torch")
    with pytest.raises(TensorParallelError, match="num_attention_heads"):
        TensorParallelExecutor.start(recipe, ParallelConfig(tensor_parallel_size=3), progress=False)
    assert multiprocessing.active_children() == []  # refused before any worker was spawned


def test_tensor_parallel_nccl_settings_fill_in_but_never_override_the_environment():
    environ = {"NCCL_MIN_NCHANNELS": "16", "PATH": "/usr/bin"}
    config = ParallelConfig(tensor_parallel_size=2, nccl_env={"NCCL_IB_DISABLE": "1"})
    applied = apply_nccl_env(config, environ)
    assert applied == [
        ("NCCL_IB_DISABLE", "1", "config"),
        ("NCCL_MIN_NCHANNELS", "16", "environment"),
        ("NCCL_NVLS_ENABLE", "0", "config"),
        ("NCCL_SOCKET_NTHREADS", "8", "config"),
    ]
    assert environ["NCCL_MIN_NCHANNELS"] == "16" and environ["NCCL_NVLS_ENABLE"] == "0"
    with pytest.raises(ConfigError, match="NCCL_"):
        ParallelConfig(nccl_env={"LD_PRELOAD": "x"}).validate()


# -- the executor: this process is rank 0 -------------------------------------------------------


def _sequence(seq_id: str, prompt: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=seq_id, index=0, prompt_token_ids=list(prompt),
                    params=SamplingParams(temperature=0.0), max_tokens=NEW_TOKENS, arrival_time=0.0)


def runner_greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Drive a runner as the scheduler would: prompt 0 prefilled in two chunks (the first samples
    nothing), prompt 1 joining in the second step, then batched decodes."""
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)
    runner.allocate_kv_cache(per_seq * len(prompts))
    seqs = [_sequence(f"seq-{i}", p) for i, p in enumerate(prompts)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    a, b = seqs
    split = 4
    steps = [
        [ScheduledSequence(a, a.prompt_token_ids[:split], 0, tables[0], samples=False)],
        [ScheduledSequence(a, a.prompt_token_ids[split:], split, tables[0], samples=True),
         ScheduledSequence(b, list(b.prompt_token_ids), 0, tables[1], samples=True)],
    ]
    outputs = [runner.execute(SchedulerOutput(scheduled=step)) for step in steps]
    assert outputs[0].sampled == {}
    for seq in seqs:
        seq.append_output_token(outputs[1].sampled[seq.seq_id].token_id)
    while len(a.output_token_ids) < new_tokens:
        step = [ScheduledSequence(s, [s.all_token_ids[-1]], s.num_tokens - 1, t, samples=True)
                for s, t in zip(seqs, tables, strict=True)]
        sampled = runner.execute(SchedulerOutput(scheduled=step)).sampled
        for seq in seqs:
            seq.append_output_token(sampled[seq.seq_id].token_id)
    return [list(seq.output_token_ids) for seq in seqs]


def _recipe() -> ModelRecipe:
    return ModelRecipe.random(CASES["gqa_kv_heads_split"], seed=SEED, device="cpu", dtype="float32",
                              attention_backend="torch")


def _assert_nothing_left(executor: TensorParallelExecutor) -> None:
    assert not any(executor.workers_alive)
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_tensor_parallel_executor_steps_match_a_single_process_runner():
    cpu = torch.device("cpu")
    reference = ModelRunner(_recipe().load(cpu).model, cpu, torch.float32, BLOCK_SIZE, Sampler((), cpu))
    expected = runner_greedy(reference, PROMPTS, NEW_TOKENS)

    executor = TensorParallelExecutor.start(_recipe(), ParallelConfig(tensor_parallel_size=2), progress=False)
    try:
        model = executor.loaded.model
        assert model.tensor_parallel.num_kv_heads == 1 and model.tensor_parallel.world_size == 2
        runner = executor.make_runner(model, cpu, torch.float32, BLOCK_SIZE, Sampler((), cpu))
        got = runner_greedy(runner, PROMPTS, NEW_TOKENS)
        assert runner.kv_caches[0][0].shape[2] == 1  # rank 0's cache holds its K/V head only
    finally:
        executor.shutdown()
    assert got == expected
    _assert_nothing_left(executor)


@pytest.mark.timeout(120)
def test_tensor_parallel_worker_crash_fails_the_step_instead_of_hanging():
    cpu = torch.device("cpu")
    executor = TensorParallelExecutor.start(_recipe(), ParallelConfig(tensor_parallel_size=2), progress=False)
    try:
        runner = executor.make_runner(executor.loaded.model, cpu, torch.float32, BLOCK_SIZE, Sampler((), cpu))
        runner.allocate_kv_cache(16)
        executor.processes[0].kill()
        executor.processes[0].join(10)
        step = SchedulerOutput(scheduled=[ScheduledSequence(_sequence("x", PROMPTS[1]), PROMPTS[1], 0, [0], True)])
        started = time.monotonic()
        with pytest.raises(WorkerFailedError, match="rank 1 exited with signal SIGKILL") as error:
            runner.execute(step)
        assert time.monotonic() - started < 10
        assert isinstance(error.value, EngineError)  # the async engine fails in-flight requests with it
        with pytest.raises(WorkerFailedError):  # and keeps refusing: the replica is broken
            runner.execute(step)
    finally:
        executor.shutdown()
    _assert_nothing_left(executor)


def _exit_with(code: int) -> None:
    raise SystemExit(code)


def test_the_watchdog_reads_a_dead_workers_exit_without_taking_it_from_whoever_joins_it():
    """The executor's watchdog thread describes a dead rank; the thread that joins the process must still
    get its exit code (a reap in the watchdog left `exitcode` None for the joining thread under load)."""
    context = multiprocessing.get_context("spawn")
    exits, killed = context.Process(target=_exit_with, args=(3,)), context.Process(target=time.sleep, args=(60,))
    exits.start()
    killed.start()
    try:
        multiprocessing.connection.wait([exits.sentinel])
        killed.kill()
        multiprocessing.connection.wait([killed.sentinel])
        assert _exit_without_reaping(exits) == "exit code 3"
        assert _exit_without_reaping(killed) == "signal SIGKILL"
        exits.join(10)
        killed.join(10)
        assert (exits.exitcode, killed.exitcode) == (3, -9)
        assert _exit_without_reaping(exits) == "exit code 3"  # after the join, from multiprocessing
    finally:
        for process in (exits, killed):
            process.kill()
            process.join()


@pytest.mark.timeout(120)
def test_tensor_parallel_worker_error_reaches_rank_0_with_its_message():
    executor = TensorParallelExecutor.start(_recipe(), ParallelConfig(tensor_parallel_size=2), progress=False)
    try:
        cpu = torch.device("cpu")
        executor.make_runner(executor.loaded.model, cpu, torch.float32, BLOCK_SIZE, Sampler((), cpu))
        with pytest.raises(WorkerFailedError, match=r"rank 1 failed: RuntimeError: .*must be non-negative"):
            executor.call(AllocateKVCache(-1))  # only the worker runs it: rank 0 never allocates this
        executor.processes[0].join(10)
        assert executor.processes[0].exitcode == 1
    finally:
        executor.shutdown()
    _assert_nothing_left(executor)
