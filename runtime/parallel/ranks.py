"""Which torchrun rank this process is, read from the environment torchrun sets (no torch import,
so `sits serve` can tell a worker rank from rank 0 before anything heavy loads)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the replica."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_rank_info(environ: MutableMapping[str, str] = os.environ) -> RankInfo | None:
    """The rank torchrun gave this process; None outside torchrun or when torchrun started one rank."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ or "MASTER_PORT" not in environ:
        return None
    world_size = int(environ["WORLD_SIZE"])
    if world_size < 2:
        return None
    rank = int(environ["RANK"])
    return RankInfo(rank=rank, world_size=world_size, local_rank=int(environ.get("LOCAL_RANK", rank)))
