"""Rank 0 of a tensor-parallel replica: starts the workers, shards its own model, feeds them steps.

    executor = TensorParallelExecutor.start(ModelRecipe.from_engine_config(config), config.parallel)
    engine = LLMEngine(executor.loaded, config, runner_factory=executor.make_runner)
    ...
    executor.shutdown()   # also run at interpreter exit

Started by the engine, it spawns ranks 1..N-1 (multiprocessing "spawn"); under torchrun it joins the
ranks torchrun started (this process must be rank 0). Failure handling: a watchdog thread notices a
worker that dies; the next step (or the one blocked on it) raises `WorkerFailedError`, an
`EngineError`, with the worker's own error when it sent one. Workers exit when the engine's process
does, and `shutdown` terminates any that do not stop within a timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.process import BaseProcess

import torch

from sits.runtime.config import ConfigError
from sits.runtime.engine.model_input import ModelInput
from sits.runtime.engine.sampler import Sampler
from sits.runtime.models.loading import LoadedModel
from sits.runtime.parallel.channel import (
    CommandChannel,
    GroupCommandChannel,
    PipeCommandChannel,
    describe_exit,
)
from sits.runtime.parallel.commands import ConfigureRunner, Shutdown, WorkerFailedError
from sits.runtime.parallel.config import ParallelConfig
from sits.runtime.parallel.distributed import (
    ProcessGroups,
    abort_distributed,
    apply_nccl_env,
    destroy_distributed,
    device_for_rank,
    free_port,
    init_distributed,
    log_nccl_env,
)
from sits.runtime.parallel.ranks import RankInfo, torchrun_rank_info
from sits.runtime.parallel.recipe import ModelRecipe
from sits.runtime.parallel.runner import TensorParallelModelRunner
from sits.runtime.parallel.step_broadcast import broadcast_packed, pack_model_input
from sits.runtime.parallel.tp import check_tensor_parallel_size
from sits.runtime.parallel.worker import COLLECTIVE_TIMEOUT_S, load_and_shard, spawned_worker_main

logger = logging.getLogger(__name__)

# Commands other than loading (runner set-up, cache allocation, profiling) answer within this, in seconds.
COMMAND_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0


@dataclass(eq=False, repr=False)
class TensorParallelExecutor:
    """The workers, channels and process group of one replica, seen from rank 0.

    Attributes:
        loaded: rank 0's model (already sharded), tokenizer and shape.
        world_size: ranks in the replica.
        groups: the replica's process groups.
        channel: rank 0's command channel to the workers.
        processes: spawned worker processes (empty under torchrun); a watchdog thread watches them.
    """

    loaded: LoadedModel
    world_size: int
    groups: ProcessGroups
    channel: CommandChannel
    processes: list[BaseProcess]
    _stopping: threading.Event = field(default_factory=threading.Event, init=False)
    _worker_died: threading.Event = field(default_factory=threading.Event, init=False)
    _closed: bool = field(default=False, init=False)
    _watchdog: threading.Thread | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.processes:
            self._watchdog = threading.Thread(target=self._watch, name="sits-tp-watchdog", daemon=True)
            self._watchdog.start()
        atexit.register(self.shutdown)

    # -- start -----------------------------------------------------------------------------
    @classmethod
    def start(cls, recipe: ModelRecipe, parallel: ParallelConfig, *, progress: bool = True) -> TensorParallelExecutor:
        """Start a replica of parallel.tensor_parallel_size ranks and load the model on each.

        Raises:
            ConfigError: the size does not split the model (TensorParallelError), too few GPUs,
                or a torchrun layout that does not match.
            ModelLoadError: rank 0 cannot load the model.
            WorkerFailedError: a worker failed while starting (its error is in the message).
        """
        parallel.validate()
        world_size = parallel.tensor_parallel_size
        check_tensor_parallel_size(recipe.llama_config(progress), world_size)
        device_type = recipe.device_type
        applied = apply_nccl_env(parallel)
        if device_type == "cuda":
            log_nccl_env(applied)
        torchrun = torchrun_rank_info()
        if torchrun is not None:
            return cls._join_torchrun(recipe, parallel, torchrun, device_type, progress)
        if device_type == "cuda" and torch.cuda.device_count() < world_size:
            raise ConfigError(
                f"--tensor-parallel-size {world_size} needs {world_size} GPUs, {torch.cuda.device_count()} are visible"
            )
        return cls._spawn(recipe, parallel, device_type, progress)

    @classmethod
    def _spawn(cls, recipe: ModelRecipe, parallel: ParallelConfig, device_type: str, progress: bool):
        world_size = parallel.tensor_parallel_size
        port = parallel.distributed_port or free_port()
        context = multiprocessing.get_context("spawn")
        processes, connections = [], []
        try:
            for rank in range(1, world_size):
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=spawned_worker_main, name=f"sits-tp-worker-{rank}",
                    args=(rank, world_size, port, recipe, child_end, logging.getLogger().getEffectiveLevel()),
                )
                process.start()
                child_end.close()
                processes.append(process)
                connections.append(parent_end)
            channel = PipeCommandChannel(connections, processes)
            channel.replies(parallel.startup_timeout_s)  # Hello: each worker is up and joining
            device = device_for_rank(device_type, 0)
            groups = init_distributed(0, world_size, device, port=port, timeout_s=COLLECTIVE_TIMEOUT_S,
                                      with_control_group=False)
            logger.info("tensor parallel: %d ranks, workers spawned as pids %s",
                        world_size, ", ".join(str(p.pid) for p in processes))
            loaded = load_and_shard(recipe, device, 0, world_size, groups.device, progress)
            channel.replies(parallel.startup_timeout_s)  # Ready: every worker holds its shard
        except BaseException:
            _stop_processes(processes, connections, timeout_s=1.0)  # they may be blocked joining the group
            destroy_distributed()
            raise
        return cls(loaded, world_size, groups, channel, processes)

    @classmethod
    def _join_torchrun(cls, recipe: ModelRecipe, parallel: ParallelConfig, info: RankInfo, device_type: str,
                       progress: bool):
        world_size = parallel.tensor_parallel_size
        if info.rank != 0:
            raise ConfigError(f"torchrun rank {info.rank} must run the worker loop, not the engine")
        if info.world_size != world_size:
            raise ConfigError(
                f"--tensor-parallel-size {world_size} but torchrun started {info.world_size} ranks"
            )
        device = device_for_rank(device_type, info.local_rank)
        groups = init_distributed(0, world_size, device, port=None, timeout_s=COLLECTIVE_TIMEOUT_S,
                                  with_control_group=True)
        try:
            loaded = load_and_shard(recipe, device, 0, world_size, groups.device, progress)
            channel = GroupCommandChannel(groups.control)
            channel.replies(parallel.startup_timeout_s)
        except BaseException:
            destroy_distributed()
            raise
        return cls(loaded, world_size, groups, channel, [])

    # -- what the engine's runner uses -----------------------------------------------------
    def make_runner(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, block_size: int,
                    sampler: Sampler) -> TensorParallelModelRunner:
        """The engine's runner (ModelRunner's constructor signature); the workers build theirs."""
        self.call(ConfigureRunner(block_size))
        return TensorParallelModelRunner(model, device, dtype, block_size, sampler, self)

    def send(self, command) -> None:
        self.check_healthy()
        self.channel.send(command)

    def replies(self, timeout_s: float = COMMAND_TIMEOUT_S) -> list:
        return self.channel.replies(timeout_s)

    def call(self, command, timeout_s: float = COMMAND_TIMEOUT_S) -> list:
        """Send a command and wait for every worker's reply."""
        self.send(command)
        return self.replies(timeout_s)

    def broadcast_step(self, model_input: ModelInput) -> None:
        """Send one step's batch: header over the channel, packed indices over the device group."""
        header, packed = pack_model_input(model_input)
        self.send(header)
        broadcast_packed(packed, self.groups.device)

    # -- health ----------------------------------------------------------------------------
    def check_healthy(self) -> None:
        """Raise WorkerFailedError if a worker died, or the replica was shut down."""
        if self._closed:
            raise WorkerFailedError("the tensor-parallel workers were shut down")
        if self._worker_died.is_set():
            raise self.worker_failure(wait_s=1.0) or WorkerFailedError("a tensor-parallel worker exited")

    def worker_failure(self, wait_s: float = 0.0) -> WorkerFailedError | None:
        """The failure of a dead worker, or None while all live (waits up to wait_s for one dying)."""
        if isinstance(self.channel, PipeCommandChannel):
            return self.channel.failure(wait_s)
        return None

    def _watch(self) -> None:
        sentinels = [process.sentinel for process in self.processes]
        while not self._stopping.is_set():
            if not connection.wait(sentinels, timeout=0.5) or self._stopping.is_set():
                continue
            self._worker_died.set()
            ended = set(connection.wait(sentinels, timeout=0))
            dead = [f"rank {rank} ({_exit_without_reaping(p)})" for rank, p in enumerate(self.processes, start=1)
                    if p.sentinel in ended]
            logger.error("tensor-parallel worker %s exited; the engine cannot run more steps", ", ".join(dead))
            abort_distributed()  # unblocks rank 0 if it waits on the dead rank inside NCCL
            return

    # -- stop ------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every worker (terminate those that do not exit within timeout_s) and leave the group.

        Idempotent; also registered to run at interpreter exit.
        """
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        atexit.unregister(self.shutdown)
        with contextlib.suppress(Exception):  # a dead worker cannot be told; it is reaped below
            self.channel.send(Shutdown())
        # Leave the group first: a worker's teardown may wait for every rank to leave.
        destroy_distributed()
        connections = self.channel.connections if isinstance(self.channel, PipeCommandChannel) else []
        _stop_processes(self.processes, connections, timeout_s)
        self.channel.close()
        if self._watchdog is not None:
            self._watchdog.join(timeout=2.0)
        logger.info("tensor parallel: workers stopped")

    @property
    def workers_alive(self) -> list[bool]:
        return [process.is_alive() for process in self.processes]


def _exit_without_reaping(process: BaseProcess) -> str:
    """How an ended worker exited ("exit code N" / "signal NAME"), read without reaping it.

    The watchdog thread only observes (waitid with WNOWAIT): `multiprocessing` processes are not safe to
    poll from two threads, and a reap here would leave None as the exit code that the thread joining
    the process reads.
    """
    deadline = time.monotonic() + 2.0
    while True:  # the sentinel closes as the process exits, a moment before the kernel can report it
        try:
            info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped by a join: multiprocessing holds the code
            return describe_exit(process.exitcode)
        if info is not None or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    if info is None:
        return describe_exit(None)
    return describe_exit(info.si_status if info.si_code == os.CLD_EXITED else -info.si_status)


def _stop_processes(processes: list[BaseProcess], connections: list[connection.Connection],
                    timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Join each process; terminate, then kill, one that outlives timeout_s seconds."""
    for process in processes:
        process.join(timeout_s)
    for process in processes:
        if process.is_alive():
            logger.warning("tensor-parallel worker %s did not stop; terminating it", process.name)
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in connections:
        with contextlib.suppress(OSError):
            conn.close()
