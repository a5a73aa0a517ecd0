"""The pool of KV-cache blocks: reference counts, the prefix-hash index and free blocks.

Every block is in exactly one of three states:
  - empty: no hash, no reference; handed out first;
  - in use: ref_count > 0 (shared by every sequence whose prefix hit it);
  - evictable: ref_count 0 but still cached under its hash, so a later prompt can hit it; handed
    out (losing its hash) only when no empty block is left, in the order the EvictionPolicy picks.
Pure bookkeeping: the K/V tensors live in the model runner, indexed by `block_id`.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable

from sits.runtime.engine.eviction import BlockOwner, EvictionPolicy, KVBlock, LRUEvictionPolicy
from sits.runtime.engine.prefix_hash import BlockHash


class BlockPool:
    """Hands out and takes back blocks, keeping released full blocks findable by hash.

    Args:
        num_blocks: blocks in the cache.
        enable_caching: keep hashes of released blocks (prefix caching); off, released blocks
            are empty at once.
        eviction_policy: orders evictable blocks; LRU by default.
        clock: seconds, for `KVBlock.last_used_time` (monotonic by default).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction_policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.eviction_policy = eviction_policy if eviction_policy is not None else LRUEvictionPolicy()
        self._clock = clock
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self._empty: deque[KVBlock] = deque(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._used_by_tenant: Counter[str] = Counter()
        self._charged_tenant: list[str | None] = [None] * num_blocks  # whose usage a held block counts in
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: empty plus evictable."""
        return len(self._empty) + len(self.eviction_policy)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (in use or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def used_blocks_by_tenant(self) -> dict[str, int]:
        """Referenced blocks per tenant (a shared block counts for its first holder's tenant)."""
        return {tenant: count for tenant, count in self._used_by_tenant.items() if count > 0}

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block holding this prefix hash, in use or evictable, or None."""
        return self._cached.get(block_hash)

    # -- state changes ---------------------------------------------------------------------
    def allocate(self, count: int, owner: BlockOwner) -> list[KVBlock] | None:
        """`count` blocks with ref_count 1, empty ones first, then evicted ones; None if too few."""
        if count > self.num_free_blocks:
            return None
        taken: list[KVBlock] = []
        for _ in range(count):
            if self._empty:
                block = self._empty.popleft()
            else:
                block = self.eviction_policy.pop_victim(owner)
                if block is None:  # a policy that refuses: undo, report failure
                    self.release(reversed(taken))
                    return None
                self._drop_hash(block)
                self.num_evictions += 1
            self._take(block, owner)
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock], owner: BlockOwner) -> None:
        """Add a reference to each block (a prefix hit), taking evictable ones out of reach."""
        for block in blocks:
            if block.ref_count == 0:
                if block.block_hash is None:
                    raise RuntimeError(f"block {block.block_id} is empty; only cached blocks can be hit")
                self.eviction_policy.remove(block)
            self._take(block, owner)

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block; a block nobody holds becomes evictable or empty.

        Pass a sequence's blocks last-first: under LRU its tail (least shared) goes first.
        """
        now = self._clock()
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_count -= 1
            block.last_used_time = now
            self.eviction_policy.on_release(block)
            if block.ref_count > 0:
                continue
            tenant = self._charged_tenant[block.block_id]
            if tenant is not None:
                self._used_by_tenant[tenant] -= 1
                self._charged_tenant[block.block_id] = None
            if block.block_hash is not None and self.enable_caching:
                self.eviction_policy.add(block)
            else:
                self._drop_hash(block)
                self._empty.append(block)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Make a full, computed block findable under `block_hash`.

        If another block already holds the same prefix (two requests computed it at once), the
        first stays the one findable and this one remains private to its sequence.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every evictable block's hash (in-use blocks keep theirs); returns how many."""
        dropped = 0
        while (block := self.eviction_policy.pop_victim(None)) is not None:
            self._drop_hash(block)
            self._empty.append(block)
            dropped += 1
        return dropped

    # -- internals -------------------------------------------------------------------------
    def _take(self, block: KVBlock, owner: BlockOwner) -> None:
        if block.ref_count == 0:
            self._used_by_tenant[owner.tenant] += 1
            self._charged_tenant[block.block_id] = owner.tenant
        block.ref_count += 1
        block.last_owner = owner
        block.last_used_time = self._clock()
        self.eviction_policy.on_allocate(block, owner)

    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
