"""The messages between the engine's rank and its workers (small picklable values).

Rank 0 → workers: `StepHeader` (step_broadcast.py; no reply), `ConfigureRunner`, `AllocateKVCache`,
`ProfileMemory` (each answered by one `Reply` per worker), `Shutdown`.
Workers → rank 0: `Reply` (`Hello` while starting, `Ready` after loading), or `Failure` before a
worker exits on an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sits.runtime.engine.errors import EngineError


class WorkerFailedError(EngineError):
    """A tensor-parallel worker died or raised: the replica cannot compute any more steps."""


@dataclass(frozen=True)
class ConfigureRunner:
    """Build the worker's model runner for this KV block size (tokens)."""

    block_size: int


@dataclass(frozen=True)
class AllocateKVCache:
    """Allocate the worker's KV cache shard: num_blocks blocks of its own K/V heads, stored as the torch
    dtype named cache_dtype (None: the model's; "float8_e4m3fn": with static scales of its own heads)."""

    num_blocks: int
    cache_dtype: str | None = None


@dataclass(frozen=True)
class ProfileMemory:
    """Run the same profiling forward as rank 0 (its collectives pair with rank 0's); reply the profile."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


@dataclass(frozen=True)
class Shutdown:
    """Leave the process group and exit."""


@dataclass(frozen=True)
class Hello:
    """A spawned worker is up and about to join the process group."""


@dataclass(frozen=True)
class Ready:
    """The worker built and sharded its model."""


@dataclass(frozen=True)
class Reply:
    """A worker's answer to a command (payload: None, Hello, Ready or a MemoryProfile)."""

    rank: int
    payload: Any = None


@dataclass(frozen=True)
class Failure:
    """A worker's last message: the error that stops it, with its traceback."""

    rank: int
    error: str
    traceback: str
