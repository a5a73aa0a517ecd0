"""The pool of KV-cache blocks: reference counts, the prefix-hash index and free blocks.

Every block is in exactly one of three states:
  - empty: no hash, no reference; handed out first;
  - in use: ref_count > 0 (shared by every sequence whose prefix hit it);
  - evictable: ref_count 0 but still cached under its hash, so a later prompt can hit it; handed
    out (losing its hash) only when no empty block is left, in the order the EvictionPolicy picks.
The pool knows blocks only: which tenant holds or uses each block is the owner map's
(`self.owners`, `block_owners.BlockOwners`), which the pool charges as blocks change state and
the eviction policy reads. Pure bookkeeping: the K/V tensors live in the model runner, indexed by
`block_id`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from sits.runtime.engine.eviction import BlockOwner, EvictionPolicy, KVBlock, LRUEvictionPolicy
from sits.runtime.engine.prefix_hash import BlockHash


class BlockPool:
    """Hands out and takes back blocks, keeping released full blocks findable by hash.

    Args:
        num_blocks: blocks in the cache.
        enable_caching: keep hashes of released blocks (prefix caching); off, released blocks
            are empty at once.
        eviction_policy: orders evictable blocks; LRU by default. Bound to this pool (`bind`),
            it supplies the owner map the pool charges.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction_policy: EvictionPolicy | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.eviction_policy = eviction_policy if eviction_policy is not None else LRUEvictionPolicy()
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self._empty: deque[KVBlock] = deque(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.owners = self.eviction_policy.bind(self)
        # Told of each cached block evicted for reuse, before its hash is dropped (a lower tier
        # keeps a copy: `host_tier.HostKVTier.offload`): (block, tenant holding it).
        self.on_evict: Callable[[KVBlock, str | None], None] | None = None

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
        """Referenced blocks per tenant (a shared block counts for the tenant that referenced it first)."""
        return self.owners.used.snapshot()

    def held_blocks_by_tenant(self) -> dict[str, int]:
        """Non-empty blocks (in use or cached) per holding tenant."""
        return self.owners.held.snapshot()

    def holder_of(self, block: KVBlock) -> str | None:
        """The tenant holding a non-empty block: the one it was allocated to (who computed it)."""
        return self.owners.holder_of(block.block_id)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block holding this prefix hash, in use or evictable, or None."""
        return self._cached.get(block_hash)

    def cached_hashes(self) -> frozenset[BlockHash]:
        """The prefix hashes a prompt can hit now (in use or evictable); at most `num_blocks`."""
        return frozenset(self._cached)

    # -- state changes ---------------------------------------------------------------------
    def allocate(self, count: int, owner: BlockOwner) -> list[KVBlock] | None:
        """`count` blocks with ref_count 1, empty ones first, then evicted ones.

        None, with nothing changed, when too few blocks are free or the eviction policy refuses
        (the owner's shard is full, or no evictable block may be taken for it).
        """
        if count > self.num_free_blocks or not self.eviction_policy.can_allocate(owner, count):
            return None
        taken: list[KVBlock] = []
        for _ in range(count):
            block: KVBlock | None
            if self._empty and self.eviction_policy.may_take_empty(owner):
                block = self._empty.popleft()
            else:
                block = self.eviction_policy.pop_victim(owner)
                if block is None:  # the policy protects what is left: undo, report failure
                    self.release(reversed(taken))
                    return None
                if self.on_evict is not None and block.block_hash is not None:
                    self.on_evict(block, self.owners.holder_of(block.block_id))
                self._make_empty(block)
                self.num_evictions += 1
            self.owners.charge(block.block_id, owner.tenant)
            self._reference(block, owner)
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock], owner: BlockOwner) -> None:
        """Add a reference to each cached block (a prefix hit); evictable ones leave the evictable set."""
        for block in blocks:
            if block.block_hash is None:
                raise RuntimeError(f"block {block.block_id} is not cached; only cached blocks can be hit")
            if block.ref_count == 0:
                self.eviction_policy.remove(block)
            self._reference(block, owner)

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block; a block nobody holds becomes evictable or empty.

        Pass a sequence's blocks last-first: under LRU its tail (least shared) goes first.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self.owners.unuse(block.block_id)
            if block.block_hash is not None and self.enable_caching:
                self.eviction_policy.add(block)
            else:
                self._make_empty(block)
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
            self._make_empty(block)
            self._empty.append(block)
            dropped += 1
        return dropped

    # -- internals -------------------------------------------------------------------------
    def _reference(self, block: KVBlock, owner: BlockOwner) -> None:
        """Add `owner`'s reference and stamp it on the block (its last use: `KVBlock.last_used_time`)."""
        if block.ref_count == 0:
            self.owners.use(block.block_id, owner.tenant)
        block.ref_count += 1
        block.last_owner = owner

    def _make_empty(self, block: KVBlock) -> None:
        """Drop the block's hash; its holder no longer holds it."""
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
        self.owners.uncharge(block.block_id)
