"""Which cached block to give up when the block pool runs out of empty ones.

A block whose last reference is released keeps its prefix hash and stays findable by later
requests ("evictable"). When a request needs a block and no empty one is left, the pool asks its
`EvictionPolicy` for a victim among the evictable blocks, drops the victim's hash and hands the
block out. The default, `LRUEvictionPolicy`, gives up the block released longest ago. The tenancy
layer plugs in a score policy (`t x (1 + alpha x priority)` with t the block's `last_used_time`,
taking first from tenants above their share) by implementing this interface, reading which tenant
holds which block from the pool's owner map (`block_owners.BlockOwners`); the pool itself never
changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from sits.runtime.engine.block_owners import BlockOwners
from sits.runtime.engine.prefix_hash import BlockHash
from sits.runtime.tenancy.request_ids import request_id_unix_ms

if TYPE_CHECKING:
    from sits.runtime.engine.block_pool import BlockPool


@dataclass(frozen=True)
class BlockOwner:
    """Who holds or last held a block: what a scoring or sharding policy needs to know.

    Attributes:
        request_id: the client request (time-ordered ids let a policy read the request's age).
        tenant: the tenant whose shard the block counts against.
        priority: the request's priority (0 lowest; higher is kept longer).
    """

    request_id: str
    tenant: str = "default"
    priority: int = 0

    @cached_property
    def issued_at(self) -> float | None:
        """Unix seconds at which the request was issued: the time its UUIDv7 id carries (read once
        per owner, when first asked), None for an id without one (client-chosen)."""
        try:
            return request_id_unix_ms(self.request_id) / 1000.0
        except ValueError:
            return None


@dataclass(eq=False)
class KVBlock:
    """One block of the paged KV cache as the pool tracks it (the tensors live in the runner).

    Attributes:
        block_id: index into the cache tensors' first dimension.
        ref_count: sequences whose block table holds this block.
        block_hash: prefix hash when the block is full and cached, else None.
        last_owner: the request that last referenced the block (allocated it or hit it), stamped
            by the pool on every reference.
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    last_owner: BlockOwner | None = None

    @property
    def last_used_time(self) -> float | None:
        """Unix seconds of the block's last use: when the request that last referenced it was
        issued (`BlockOwner.issued_at`); None when unknown (never referenced, or a client-chosen id)."""
        return self.last_owner.issued_at if self.last_owner is not None else None


class EvictionPolicy(ABC):
    """Orders the evictable blocks (cached, ref_count 0) and picks the next victim.

    The pool calls `add` when a cached block's last reference is released, `remove` when a
    prefix hit takes an evictable block back, and `pop_victim` when it needs a block and has no
    empty one. Who holds which block is not the policy's to track: the pool charges its owner map
    (`bind` returns it) and a tenancy policy reads it, to keep per-tenant shards and refuse
    allocations beyond a tenant's headroom (`can_allocate`, `may_take_empty`).
    """

    @abstractmethod
    def add(self, block: KVBlock) -> None:
        """`block` became evictable (its last reference was released; it keeps its hash)."""

    @abstractmethod
    def remove(self, block: KVBlock) -> None:
        """`block` (currently evictable) is referenced again and must not be chosen."""

    @abstractmethod
    def pop_victim(self, requester: BlockOwner | None) -> KVBlock | None:
        """Remove from the evictable set and return the block to evict for `requester`
        (None: a cache reset), or None when no block may be evicted for it."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""

    def bind(self, pool: BlockPool) -> BlockOwners:
        """Called once by the pool this policy serves; returns the owner map the pool charges.

        A fresh map by default; a policy that reads the map (tenant shards) returns the one it
        built, and may keep `pool` to read its blocks."""
        return BlockOwners(pool.num_blocks)

    def can_allocate(self, owner: BlockOwner, num_blocks: int) -> bool:
        """Whether `owner` may be handed `num_blocks` more blocks at all (checked once per call)."""
        return True

    def may_take_empty(self, owner: BlockOwner) -> bool:
        """Whether `owner` may take an empty block now (asked per block); if not, the pool evicts
        a victim for it instead, and refuses when there is none."""
        return True

    def max_blocks(self, tenant: str) -> int | None:
        """The most blocks `tenant` can ever hold at once (None: the whole cache). A sequence that
        needs more could never finish, so the engine refuses or shortens it up front."""
        return None

    def preemption_helps(self, requester: BlockOwner, victim: BlockOwner) -> bool:
        """Whether preempting `victim`'s running sequence frees blocks `requester` may then take
        (a shard policy says no for a tenant within its guarantee: its blocks are its own)."""
        return True


class LRUEvictionPolicy(EvictionPolicy):
    """Evict the block whose last reference was released longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, KVBlock] = OrderedDict()

    def add(self, block: KVBlock) -> None:
        self._order[block.block_id] = block

    def remove(self, block: KVBlock) -> None:
        del self._order[block.block_id]

    def pop_victim(self, requester: BlockOwner | None) -> KVBlock | None:
        if not self._order:
            return None
        _, block = self._order.popitem(last=False)
        return block

    def __len__(self) -> int:
        return len(self._order)
