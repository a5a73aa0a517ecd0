"""Where each prompt prefix is cached: the replicas' own word (KVIndex) and the router's memory of
where it sent prompts (RoutingHistory).

Hashes chain (a block's hash names its whole prefix), so a replica holds a prompt's first k blocks
exactly when it holds block k-1's hash and, in a cache that fills front to back, the ones before:
the match of a replica is the longest run of the prompt's hashes from the start that it holds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sits.runtime.engine.prefix_hash import BlockHash


@dataclass(frozen=True)
class ReplicaKV:
    """One replica's published KV state as the router last read it.

    Attributes:
        block_hashes: prefix hashes its cache holds.
        waiting: requests queued on it.
        kv_usage: fraction of its KV blocks referenced by running requests, 0..1.
        published_at: unix seconds of its last publication.
    """

    block_hashes: frozenset[BlockHash] = field(default_factory=frozenset)
    waiting: int = 0
    kv_usage: float = 0.0
    published_at: float = 0.0


def leading_matches(hashes: Sequence[BlockHash], holds: Callable[[BlockHash], bool]) -> int:
    """How many of `hashes`, from the first, `holds` accepts without a gap."""
    count = 0
    for block_hash in hashes:
        if not holds(block_hash):
            break
        count += 1
    return count


class KVIndex:
    """Replica id -> its published KV state; replaced wholesale by each read of the store."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaKV] = {}

    def replace(self, states: dict[str, ReplicaKV]) -> None:
        self._replicas = dict(states)

    def clear(self) -> None:
        self._replicas = {}

    def get(self, replica_id: str | None) -> ReplicaKV | None:
        return self._replicas.get(replica_id) if replica_id is not None else None

    def match(self, replica_id: str | None, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` the replica holds (0 when it published nothing)."""
        state = self.get(replica_id)
        return leading_matches(hashes, state.block_hashes.__contains__) if state else 0

    def __len__(self) -> int:
        return len(self._replicas)


class RoutingHistory:
    """The replica each prefix block was last sent to, and when: a bounded LRU over block hashes.

    Args:
        max_blocks: hashes remembered (the oldest are forgotten first); ~100 bytes each.
        clock: seconds (monotonic).
    """

    def __init__(self, max_blocks: int = 200_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self._clock = clock
        self._where: OrderedDict[BlockHash, tuple[str, float]] = OrderedDict()

    def record(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        now = self._clock()
        for block_hash in hashes:
            self._where[block_hash] = (replica, now)
            self._where.move_to_end(block_hash)
        while len(self._where) > self.max_blocks:
            self._where.popitem(last=False)

    def match(self, replica: str, hashes: Sequence[BlockHash], max_age_s: float | None = None) -> int:
        """Leading blocks of `hashes` last sent to `replica` (within `max_age_s` seconds if given)."""
        oldest = None if max_age_s is None else self._clock() - max_age_s

        def holds(block_hash: BlockHash) -> bool:
            entry = self._where.get(block_hash)
            return entry is not None and entry[0] == replica and (oldest is None or entry[1] >= oldest)

        return leading_matches(hashes, holds)

    def forget(self, replica: str) -> None:
        """Drop what was sent to a replica (it died: its cache is gone)."""
        for block_hash in [h for h, (r, _) in self._where.items() if r == replica]:
            del self._where[block_hash]

    def __len__(self) -> int:
        return len(self._where)
