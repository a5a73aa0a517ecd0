"""Joining and leaving the process group of one tensor-parallel replica.

Two ways in:
- spawned: the engine process is rank 0 and starts ranks 1..N-1 itself (`executor.py`); they meet
  at tcp://127.0.0.1:<port>, a free port unless `ParallelConfig.distributed_port` names one;
- torchrun: torchrun started every rank and passed RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
  MASTER_PORT; the group is initialised from those (`env://`).

The group's back end is NCCL on CUDA and gloo on CPU. Rank r runs on cuda:LOCAL_RANK (spawned:
cuda:r). NCCL reads its variables when the first communicator is created, so `apply_nccl_env` runs
before any rank starts, and spawned workers inherit the result.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sits.runtime.parallel.config import ParallelConfig

logger = logging.getLogger(__name__)

# Under torchrun, idle workers wait for the next command inside a gloo broadcast; its timeout must
# outlast the longest quiet spell of a server.
CONTROL_GROUP_TIMEOUT = timedelta(days=365)


@dataclass
class ProcessGroups:
    """The groups a rank talks through.

    Attributes:
        device: the default group (NCCL on CUDA, gloo on CPU): the model's all-reduce / all-gather
            and each step's packed input tensor.
        control: a gloo group for pickled commands under torchrun; None when the workers were
            spawned (commands then travel over pipes).
        backend: "nccl" or "gloo".
    """

    device: dist.ProcessGroup
    control: dist.ProcessGroup | None
    backend: str


def apply_nccl_env(config: ParallelConfig, environ: MutableMapping[str, str] = os.environ) -> list[tuple[str, str, str]]:
    """Put the config's NCCL settings into the environment, never over a value already there.

    Returns:
        (name, value in effect, "environment" or "config") for every setting, sorted by name.
    """
    applied = []
    for name, value in sorted(config.nccl_settings().items()):
        if name in environ:
            applied.append((name, environ[name], "environment"))
        else:
            environ[name] = value
            applied.append((name, value, "config"))
    return applied


def log_nccl_env(applied: list[tuple[str, str, str]]) -> None:
    logger.info("NCCL settings: %s", ", ".join(f"{name}={value} ({source})" for name, value, source in applied))


def device_for_rank(device_type: str, local_rank: int) -> torch.device:
    """The device rank `local_rank` computes on (made the current CUDA device)."""
    if device_type != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"tensor-parallel rank {local_rank} needs cuda:{local_rank}, but only {count} GPUs are visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_distributed(
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    port: int | None,
    timeout_s: float,
    with_control_group: bool,
) -> ProcessGroups:
    """Join the replica's default process group (and, under torchrun, its gloo control group).

    Args:
        rank, world_size: this rank and the number of ranks.
        device: this rank's device (picks NCCL or gloo).
        port: rendezvous port on 127.0.0.1; None reads MASTER_ADDR / MASTER_PORT (torchrun).
        timeout_s: how long collectives (and the rendezvous) may wait, in seconds.
        with_control_group: also create the gloo group commands travel through under torchrun.
    """
    backend = backend_for(device)
    init_method = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s), **kwargs,
    )
    control = None
    if with_control_group:
        control = dist.new_group(backend="gloo", timeout=CONTROL_GROUP_TIMEOUT)
    logger.info("tensor parallel: rank %d of %d on %s (%s, %s)", rank, world_size, device, backend, init_method)
    return ProcessGroups(device=dist.group.WORLD, control=control, backend=backend)


def destroy_distributed() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer may be gone already; leaving must not raise
            dist.destroy_process_group()


def abort_distributed() -> None:
    """Abort in-flight NCCL work so a rank blocked on a dead peer raises instead of hanging.

    gloo notices a closed peer by itself; NCCL would wait for its watchdog timeout.
    """
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        with contextlib.suppress(Exception):
            abort()
