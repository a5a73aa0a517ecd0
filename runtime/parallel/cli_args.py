"""The command line's side of tensor parallelism: flags, and what ranks 1..N-1 run under torchrun.

    sits serve --tensor-parallel-size 2 ...                                   # the engine spawns rank 1
    torchrun --nproc-per-node 2 --no-python sits serve --tensor-parallel-size 2 ...   # torchrun starts both

Under torchrun every rank runs `sits serve`; rank 0 serves HTTP, the others call
`run_if_torchrun_worker` before binding any port and serve rank 0's steps until it shuts down.
"""

from __future__ import annotations

import argparse

from sits.runtime.parallel.config import ParallelConfig


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="GPUs one replica is sharded over (the operator passes gpusPerReplica); "
                            "the engine spawns N-1 worker processes, or joins the ranks torchrun started")
    group.add_argument("--distributed-port", type=int, default=None, metavar="PORT",
                       help="rendezvous port on 127.0.0.1 for spawned workers (default: a free port)")


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    """The validated ParallelConfig; NCCL settings keep their defaults unless the environment sets them."""
    config = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, distributed_port=args.distributed_port)
    config.validate()
    return config


def run_if_torchrun_worker(engine_config, parallel: ParallelConfig) -> int | None:
    """On torchrun ranks 1..N-1: serve rank 0's steps and return the exit code. Elsewhere: None.

    Args:
        engine_config: the EngineConfig every rank parsed from the same flags.
        parallel: its tensor-parallel settings.
    """
    from sits.runtime.parallel.ranks import torchrun_rank_info

    info = torchrun_rank_info()
    if info is None or info.rank == 0:
        return None
    from sits.runtime.parallel.recipe import ModelRecipe
    from sits.runtime.parallel.worker import run_torchrun_worker

    return run_torchrun_worker(ModelRecipe.from_engine_config(engine_config), parallel)
