"""The KV-cache manager: per-sequence block tables on top of the block pool, and prefix caching.

The scheduler talks to it in sequences and token counts only:
  - `find_prefix(seq)` -> `PrefixHit`: the longest run of the sequence's full blocks already
    cached (a waiting sequence skips computing those tokens);
  - `allocate(seq, num_new_tokens, prefix)` -> new block ids, or None when the pool is short
    (the scheduler then preempts someone or waits); nothing changes on None;
  - `cache_computed_blocks(seq)` after a step, so full blocks whose K/V now exist become hits;
  - `free(seq)` when a sequence finishes, is aborted or preempted.
The block table itself is the sequence's (`Sequence.blocks`, `block_ids`, `num_cached_blocks`):
this manager fills and frees it, and keeps one index of the sequences holding blocks (by seq_id,
for lookups such as `block_ids`), so freeing a sequence is one call that leaves nothing behind.

Prefix-cache figures are kept per tenant (`PrefixCacheCounts`), including hits on a block another
tenant computed: with per-tenant salts that count stays 0 unless the prompt was marked for the
shared-prefix pool (its salt is `shared_cache_salt`), and such hits are counted apart.

A block is only made findable once the step that writes its K/V has run (after that step's
output came back), never at allocation: a sequence preempted in the same step that allocated would
otherwise leave hashes pointing at never-written blocks. With async scheduling the next step is
already launched by then and may still be writing a block's last slots; that is safe because every
step that could read the block (a prefix hit) is launched later on the same stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sits.runtime.engine.block_pool import BlockPool
from sits.runtime.engine.eviction import BlockOwner, EvictionPolicy, KVBlock
from sits.runtime.engine.prefix_hash import extend_block_hashes
from sits.runtime.engine.sequence import Sequence
from sits.runtime.engine.stats import PrefixCacheCounts

if TYPE_CHECKING:
    from sits.runtime.engine.host_tier import HostKVTier


@dataclass
class PrefixHit:
    """Cached blocks that cover the start of a sequence.

    Attributes:
        blocks: the GPU hit blocks, in order (not yet referenced: `allocate` takes them).
        num_tokens: tokens the hit covers ((len(blocks) + len(host_blocks)) * block_size).
        host_blocks: host-tier blocks continuing the run after `blocks` (`allocate` copies them
            back into fresh GPU blocks before the step runs).
    """

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0
    host_blocks: list[KVBlock] = field(default_factory=list)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def owner_of(seq: Sequence) -> BlockOwner:
    return BlockOwner(request_id=seq.request_id, tenant=seq.tenant, priority=seq.priority)


class KVCacheManager:
    """Block tables of running sequences over one `BlockPool`.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse full blocks of earlier sequences with the same prefix.
        eviction_policy: which cached block to give up first (LRU by default).
        shared_cache_salt: the salt of prompts marked for the shared-prefix pool; hits under it
            on another tenant's blocks are expected and counted as shared, not cross-tenant.
        host_tier: a host-memory tier below the GPU cache (`--host-kv-cache-gb`): evicted cached
            blocks are kept there and prefix hits on them are copied back.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction_policy: EvictionPolicy | None = None,
        shared_cache_salt: str | None = None,
        host_tier: HostKVTier | None = None,
    ) -> None:
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.shared_cache_salt = shared_cache_salt
        self.pool = BlockPool(num_blocks, enable_prefix_caching, eviction_policy)
        self._holders: dict[str, Sequence] = {}  # the sequences holding blocks, by seq_id
        self.prefix_cache_queries = 0  # prompt tokens looked up, in tokens
        self.prefix_cache_hits = 0  # of those, tokens served from the cache
        self.prefix_counts: dict[str, PrefixCacheCounts] = {}  # the same per tenant, and more
        self.prefix_cache_host_hits = 0  # of the hits, tokens copied back from the host tier
        self.host_tier = host_tier if enable_prefix_caching else None
        if self.host_tier is not None:
            self.pool.on_evict = self.host_tier.offload

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, seq_id: str) -> list[int]:
        """The block table of the sequence `seq_id`: physical block ids in token order (a copy;
        `Sequence.block_ids` is the table itself)."""
        holder = self._holders.get(seq_id)
        return list(holder.block_ids) if holder is not None else []

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest cached run of the sequence's full blocks.

        The last token is never a hit: the model must run on it to produce the next token's
        logits, so at most (num_tokens - 1) // block_size blocks can come from the cache.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        extend_block_hashes(seq.block_hashes, seq.all_token_ids, self.block_size, max_blocks, seq.cache_salt,
                            seq.lora_name)
        hit: list[KVBlock] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        host_hit: list[KVBlock] = []
        if self.host_tier is not None:
            for block_hash in seq.block_hashes[len(hit):max_blocks]:
                host_block = self.host_tier.lookup(block_hash)
                if host_block is None:
                    break
                host_hit.append(host_block)
        return PrefixHit(blocks=hit, num_tokens=(len(hit) + len(host_hit)) * self.block_size, host_blocks=host_hit)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: PrefixHit | None = None) -> list[int] | None:
        """Reserve slots for `num_new_tokens` more tokens of `seq`; return the new block ids.

        Args:
            seq: the sequence; its context so far is `prefix.num_tokens` when a prefix is given
                (a waiting sequence being admitted), else `seq.num_computed_tokens`.
            num_new_tokens: tokens this step will compute.
            prefix: the hit from `find_prefix`, only when admitting a waiting sequence.
        Returns:
            ids of the blocks added to the table (possibly none), or None when the pool has too
            few free blocks; then nothing changed.
        """
        table = seq.blocks
        if prefix is None and seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return []  # the common decode step: the table already has the room
        hit_blocks = prefix.blocks if prefix is not None else []
        if hit_blocks and table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks; a prefix applies on admission only")
        context = prefix.num_tokens if prefix is not None else seq.num_computed_tokens
        needed = blocks_for_tokens(context + num_new_tokens, self.block_size) - len(table) - len(hit_blocks)
        # Hit blocks nobody holds are counted as free until we take them.
        reclaimed = sum(1 for block in hit_blocks if block.ref_count == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            return None
        owner = owner_of(seq)
        tier = self.host_tier
        host_blocks = prefix.host_blocks if prefix is not None and tier is not None else []
        if tier is not None and host_blocks:  # first: this allocation's evictions must not take them
            tier.hold(host_blocks, owner)
        if hit_blocks:
            self.pool.touch(hit_blocks, owner)
        new_blocks = self.pool.allocate(max(needed, 0), owner)
        if new_blocks is None:  # an eviction policy refused to evict; undo the hits
            self.pool.release(reversed(hit_blocks))
            if tier is not None and host_blocks:
                tier.unhold(host_blocks)
            return None
        if tier is not None and host_blocks:  # the host hits' positions come first among the new blocks
            tier.onload(host_blocks, [block.block_id for block in new_blocks[:len(host_blocks)]])
        if seq.seq_id not in self._holders:
            self._holders[seq.seq_id] = seq
            seq.num_cached_blocks = len(hit_blocks)
        table.extend(hit_blocks)
        table.extend(new_blocks)
        new_ids = [block.block_id for block in new_blocks]
        seq.block_ids.extend(block.block_id for block in hit_blocks)
        seq.block_ids.extend(new_ids)
        if prefix is not None and self.enable_prefix_caching and seq.num_preemptions == 0:
            self._count_lookup(seq, prefix)
        return new_ids

    def prefix_counts_snapshot(self) -> dict[str, PrefixCacheCounts]:
        """Copies of the per-tenant prefix-cache figures (for stats snapshots)."""
        return {tenant: dataclasses.replace(counts) for tenant, counts in self.prefix_counts.items()}

    def _count_lookup(self, seq: Sequence, prefix: PrefixHit) -> None:
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += prefix.num_tokens
        counts = self.prefix_counts.get(seq.tenant)
        if counts is None:
            counts = self.prefix_counts[seq.tenant] = PrefixCacheCounts()
        counts.queries += seq.num_tokens
        counts.hits += prefix.num_tokens
        host_tokens = len(prefix.host_blocks) * self.block_size
        self.prefix_cache_host_hits += host_tokens
        counts.host_hits += host_tokens
        foreign = sum(1 for block in prefix.blocks if self.pool.holder_of(block) != seq.tenant)
        if self.host_tier is not None:
            foreign += sum(1 for block in prefix.host_blocks if self.host_tier.holder_of(block) != seq.tenant)
        if foreign:
            if seq.cache_salt is not None and seq.cache_salt == self.shared_cache_salt:
                counts.shared_hits += foreign * self.block_size
            else:
                counts.cross_tenant_hits += foreign * self.block_size

    def max_tokens_for(self, tenant: str) -> int:
        """The longest sequence (prompt + output, in tokens) `tenant` can hold in the cache."""
        blocks = self.pool.eviction_policy.max_blocks(tenant)
        return (self.num_blocks if blocks is None else blocks) * self.block_size

    def preemption_helps(self, requester: Sequence, victim: Sequence) -> bool:
        """Whether preempting `victim` frees blocks `requester` may take (its shard permitting)."""
        return self.pool.eviction_policy.preemption_helps(owner_of(requester), owner_of(victim))

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Make the sequence's full blocks whose K/V are computed findable by later prompts."""
        if not self.enable_prefix_caching:
            return
        table = seq.blocks
        if not table:
            return
        # Tokens still pending (async scheduling) have no id yet, so their block cannot be hashed.
        num_full = min(seq.num_computed_tokens, len(seq.all_token_ids)) // self.block_size
        num_full = min(num_full, len(table))
        committed = seq.num_cached_blocks
        if num_full <= committed:
            return
        extend_block_hashes(seq.block_hashes, seq.all_token_ids, self.block_size, num_full, seq.cache_salt,
                            seq.lora_name)
        for index in range(committed, num_full):
            self.pool.cache(table[index], seq.block_hashes[index])
        seq.num_cached_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence, last block first (its tail is evicted first).

        The sequence gets new, empty tables: a step already launched keeps reading the old list.
        """
        table = seq.blocks
        self._holders.pop(seq.seq_id, None)
        seq.blocks, seq.block_ids, seq.num_cached_blocks = [], [], 0
        if table:
            self.pool.release(reversed(table))

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._holders

    @property
    def num_holders(self) -> int:
        """Sequences holding blocks (0 once every sequence finished or was preempted)."""
        return len(self._holders)

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block, in the host tier too; returns how many."""
        return self.pool.reset_prefix_cache() + (self.host_tier.reset() if self.host_tier is not None else 0)
