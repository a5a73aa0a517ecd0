"""A tensor-parallel worker (ranks 1..N-1): build the model, keep its shard, run what rank 0 sends.

Spawned workers (`spawned_worker_main`) talk to rank 0 over a pipe and exit when rank 0 does;
under torchrun, `run_torchrun_worker` is what `sits serve` runs on every rank but 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import traceback
from multiprocessing import connection

import torch

from sits.runtime.gc_heap import freeze_startup_heap
from sits.runtime.models.loading import LoadedModel
from sits.runtime.parallel.channel import GroupWorkerEndpoint, PipeWorkerEndpoint, WorkerEndpoint
from sits.runtime.parallel.commands import (
    AllocateKVCache,
    ConfigureRunner,
    Failure,
    Hello,
    ProfileMemory,
    Ready,
    Shutdown,
)
from sits.runtime.parallel.config import ParallelConfig
from sits.runtime.parallel.distributed import (
    ProcessGroups,
    apply_nccl_env,
    destroy_distributed,
    device_for_rank,
    init_distributed,
)
from sits.runtime.parallel.ranks import torchrun_rank_info
from sits.runtime.parallel.recipe import ModelRecipe
from sits.runtime.parallel.runner import ShardModelRunner
from sits.runtime.parallel.step_broadcast import StepHeader, receive_model_input
from sits.runtime.parallel.tp import apply_tensor_parallel

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer, in seconds (a step's collectives follow the broadcast at once).
COLLECTIVE_TIMEOUT_S = 600.0


def load_and_shard(recipe: ModelRecipe, device: torch.device, rank: int, world_size: int,
                   group, progress: bool = False) -> LoadedModel:
    """Build the full model from the recipe on this rank's device, keep this rank's shard, and
    quantize the shard when the recipe asks (every rank alike; the engine then finds rank 0's done)."""
    loaded = recipe.load(device, progress=progress)
    layout = apply_tensor_parallel(loaded.model, rank, world_size, group).tensor_parallel
    logger.info("tensor parallel rank %d/%d holds %d query heads, %d K/V heads, %d MLP columns, vocabulary rows %d..%d",
                rank, world_size, layout.num_heads, layout.num_kv_heads, layout.intermediate_size,
                layout.vocab_start, layout.vocab_start + layout.vocab_rows - 1)
    if recipe.model.quantization != "none":
        from sits.runtime.models.quantize import quantize_model

        quantize_model(loaded.model, recipe.model.quantization, fp8_mode=recipe.model.fp8_mode)
    return loaded


def serve_commands(rank: int, world_size: int, recipe: ModelRecipe, groups: ProcessGroups,
                   device: torch.device, endpoint: WorkerEndpoint) -> None:
    """Load, report Ready, then run rank 0's commands until Shutdown."""
    loaded = load_and_shard(recipe, device, rank, world_size, groups.device)
    endpoint.reply(Ready())
    runner: ShardModelRunner | None = None
    while True:
        command = endpoint.recv()
        if isinstance(command, StepHeader):
            runner.run_step(receive_model_input(command, device, groups.device))
        elif isinstance(command, ConfigureRunner):
            runner = ShardModelRunner(loaded.model, loaded.device, loaded.dtype, command.block_size)
            endpoint.reply()
        elif isinstance(command, AllocateKVCache):
            if command.cache_dtype is not None:
                runner.use_kv_cache_dtype(getattr(torch, command.cache_dtype))
            runner.allocate_kv_cache(command.num_blocks)
            freeze_startup_heap(f"tensor-parallel rank {rank}")  # a pause on one rank stalls all (gc_heap.py)
            endpoint.reply()
        elif isinstance(command, ProfileMemory):
            endpoint.reply(runner.profile_memory(command.max_num_batched_tokens, command.max_num_seqs,
                                                 command.max_model_len))
        elif isinstance(command, Shutdown):
            return
        else:
            raise TypeError(f"unknown command {command!r}")


def spawned_worker_main(rank: int, world_size: int, port: int, recipe: ModelRecipe,
                        conn: connection.Connection, log_level: int) -> None:
    """Entry point of a worker the engine spawned (a multiprocessing target)."""
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    _exit_when_parent_exits()
    endpoint = PipeWorkerEndpoint(rank, conn)
    try:
        device = device_for_rank(recipe.device_type, rank)
        if device.type == "cpu":  # ranks share the cores: do not oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        endpoint.reply(Hello())
        groups = init_distributed(rank, world_size, device, port=port, timeout_s=COLLECTIVE_TIMEOUT_S,
                                  with_control_group=False)
        serve_commands(rank, world_size, recipe, groups, device, endpoint)
    except EOFError:
        logger.info("the engine process is gone; worker rank %d exits", rank)
        os._exit(0)
    except BaseException as exc:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        endpoint.fail(Failure(rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        # No orderly teardown: leaving an NCCL group while a peer waits in a collective can block.
        logging.shutdown()
        os._exit(1)
    destroy_distributed()  # Shutdown: every rank leaves together
    conn.close()


def run_torchrun_worker(recipe: ModelRecipe, parallel: ParallelConfig) -> int:
    """Serve as rank RANK (>= 1) of a torchrun job until rank 0 shuts down; returns the exit code."""
    info = torchrun_rank_info()
    if info is None or info.rank == 0:
        raise RuntimeError("run_torchrun_worker runs on torchrun ranks 1..N-1 only")
    apply_nccl_env(parallel)
    device = device_for_rank(recipe.device_type, info.local_rank)
    groups = init_distributed(info.rank, info.world_size, device, port=None, timeout_s=COLLECTIVE_TIMEOUT_S,
                              with_control_group=True)
    try:
        serve_commands(info.rank, info.world_size, recipe, groups, device, GroupWorkerEndpoint(info.rank, groups.control))
    finally:
        destroy_distributed()
    return 0


def _exit_when_parent_exits() -> None:
    """A worker must not outlive the engine, even one blocked inside a collective."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="sits-tp-parent-watch", daemon=True).start()
