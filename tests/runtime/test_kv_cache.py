"""The paged KV cache's bookkeeping: prefix hashes, the block pool, block tables and prefix hits."""

from __future__ import annotations

from collections import Counter

import pytest

from sits.runtime.engine.block_owners import BlockOwners
from sits.runtime.engine.block_pool import BlockPool
from sits.runtime.engine.eviction import BlockOwner, EvictionPolicy, KVBlock
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.prefix_hash import extend_block_hashes, hash_block
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.sequence import Sequence

OWNER = BlockOwner("req-1", tenant="acme")


def make_seq(seq_id: str, tokens: list[int], *, salt: str | None = None, tenant: str = "default") -> Sequence:
    return Sequence(seq_id, seq_id, 0, list(tokens), SamplingParams(), max_tokens=16, arrival_time=0.0,
                    tenant=tenant, cache_salt=salt)


# -- prefix hashes ---------------------------------------------------------------------------------
def test_block_hash_names_the_whole_prefix_and_the_salt():
    first = hash_block(None, [1, 2, 3, 4])
    assert first == hash_block(None, [1, 2, 3, 4])
    assert len(first) == 32
    # Same tokens after a different parent: a different block.
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("tenant-a",)) != first
    assert hash_block(None, [1, 2, 3, 4], ("tenant-a",)) != hash_block(None, [1, 2, 3, 4], ("tenant-b",))
    # Length-prefixed keys: ("ab", "c") is not ("a", "bc").
    assert hash_block(None, [1], ("ab", "c")) != hash_block(None, [1], ("a", "bc"))


def test_block_hashes_are_computed_incrementally_over_full_blocks_only():
    tokens = list(range(11))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens[:6], block_size=4, num_full_blocks=10)
    assert len(hashes) == 1  # 6 tokens: one full block
    kept = list(hashes)
    extend_block_hashes(hashes, tokens, block_size=4, num_full_blocks=10)
    assert len(hashes) == 2 and hashes[0] == kept[0]  # earlier hashes untouched
    assert hashes == [hash_block(None, tokens[0:4]), hash_block(hashes[0], tokens[4:8])]


# -- block pool ------------------------------------------------------------------------------------
def test_pool_allocates_distinct_blocks_and_refuses_without_side_effects():
    pool = BlockPool(4)
    blocks = pool.allocate(3, OWNER)
    assert len({b.block_id for b in blocks}) == 3 and all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.allocate(2, OWNER) is None
    assert pool.num_free_blocks == 1
    assert pool.used_blocks_by_tenant() == {"acme": 3}
    pool.release(blocks)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    assert pool.used_blocks_by_tenant() == {}


def test_released_cached_blocks_stay_findable_until_reused_in_lru_order():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3, OWNER)
    pool.cache(a, b"hash-a")
    pool.cache(b, b"hash-b")
    pool.release([a])  # released first: least recently used
    pool.release([b])
    pool.release([c])  # no hash: empty at once
    assert pool.lookup(b"hash-a") is a and pool.lookup(b"hash-b") is b
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2

    (first,) = pool.allocate(1, OWNER)
    assert first is c  # empty blocks go before cached ones
    (second,) = pool.allocate(1, OWNER)
    assert second is a  # then the least recently released cached block
    assert pool.lookup(b"hash-a") is None and a.block_hash is None
    assert pool.lookup(b"hash-b") is b
    assert pool.num_evictions == 1


def test_touching_an_evictable_block_protects_it_and_counts_references():
    pool = BlockPool(2)
    (a,) = pool.allocate(1, OWNER)
    pool.cache(a, b"hash-a")
    pool.release([a])
    pool.touch([a], BlockOwner("req-2"))
    pool.touch([a], BlockOwner("req-3"))
    assert a.ref_count == 2 and a.last_owner.request_id == "req-3"
    assert pool.num_free_blocks == 1
    assert pool.allocate(2, OWNER) is None  # a is in use, not evictable
    pool.release([a])
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    pool.release([a])
    assert pool.num_free_blocks == 2 and pool.lookup(b"hash-a") is a
    with pytest.raises(RuntimeError):
        pool.release([a])


def test_duplicate_hash_keeps_the_first_block_findable():
    pool = BlockPool(2)
    a, b = pool.allocate(2, OWNER)
    pool.cache(a, b"same")
    pool.cache(b, b"same")
    assert pool.lookup(b"same") is a and b.block_hash is None
    pool.release([b])
    assert pool.num_cached_blocks == 1


def test_reset_prefix_cache_forgets_only_unreferenced_blocks():
    pool = BlockPool(2)
    a, b = pool.allocate(2, OWNER)
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.release([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(b"a") is None and pool.lookup(b"b") is b


class NewestFirstShardPolicy(EvictionPolicy):
    """Evicts the most recently released block and caps what each tenant may hold (read from the
    pool's owner map): a policy unlike the default, to show the seam a tenancy policy plugs into."""

    def __init__(self, cap_per_tenant: int) -> None:
        self.cap = cap_per_tenant
        self.evictable: list[KVBlock] = []
        self.owners: BlockOwners | None = None
        self.requesters: list[BlockOwner | None] = []

    def bind(self, pool):
        self.owners = super().bind(pool)
        return self.owners

    @property
    def held(self) -> Counter[str]:
        return Counter(self.owners.held.snapshot())

    def add(self, block):
        self.evictable.append(block)

    def remove(self, block):
        self.evictable.remove(block)

    def pop_victim(self, requester):
        self.requesters.append(requester)
        return self.evictable.pop() if self.evictable else None

    def __len__(self):
        return len(self.evictable)

    def can_allocate(self, owner, num_blocks):
        return self.held[owner.tenant] + num_blocks <= self.cap


def test_eviction_policy_is_pluggable_with_per_tenant_accounting():
    policy = NewestFirstShardPolicy(cap_per_tenant=2)
    pool = BlockPool(4, eviction_policy=policy)
    acme = BlockOwner("req-1", tenant="acme")
    a, b = pool.allocate(2, acme)
    assert pool.allocate(1, acme) is None  # acme's cap, though two blocks are free
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.release([a])
    pool.release([b])
    assert policy.held["acme"] == 2  # cached blocks still count as held

    globex = BlockOwner("req-9", tenant="globex", priority=2)
    c, d = pool.allocate(2, globex)  # the two empty blocks
    assert {c.block_id, d.block_id}.isdisjoint({a.block_id, b.block_id})
    pool.release([c, d])  # unhashed: empty again
    assert policy.held == Counter({"acme": 2, "globex": 0})

    pool.allocate(2, globex)  # empty blocks again, no eviction
    (victim,) = pool.allocate(1, BlockOwner("req-10", tenant="initech"))
    assert victim is b  # newest released first, as the plugged policy says
    assert policy.requesters[-1].tenant == "initech"
    assert policy.held == Counter({"acme": 1, "globex": 2, "initech": 1})
    assert pool.lookup(b"b") is None and pool.lookup(b"a") is a


class NoEmptyForCappedTenant(NewestFirstShardPolicy):
    def may_take_empty(self, owner):
        return owner.tenant != "capped"


def test_a_policy_can_make_a_tenant_reuse_cached_blocks_instead_of_empty_ones():
    policy = NoEmptyForCappedTenant(cap_per_tenant=10)
    pool = BlockPool(4, eviction_policy=policy)
    capped = BlockOwner("req-1", tenant="capped")
    assert pool.allocate(1, capped) is None  # nothing evictable and no empty block allowed
    (cached,) = pool.allocate(1, BlockOwner("req-2", tenant="other"))
    pool.cache(cached, b"h")
    pool.release([cached])
    (reused,) = pool.allocate(1, capped)
    assert reused is cached and pool.lookup(b"h") is None
    assert pool.num_free_blocks == 3  # the three empty blocks were left alone


# -- KV-cache manager ------------------------------------------------------------------------------
def test_block_table_grows_with_tokens_and_free_returns_everything():
    cache = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq("s", list(range(6)))
    assert cache.allocate(seq, 6, cache.find_prefix(seq)) is not None
    assert len(cache.block_ids("s")) == 2
    seq.num_computed_tokens = 6
    assert cache.allocate(seq, 2) == []  # positions 6, 7 fit in block 2
    seq.num_computed_tokens = 8
    assert len(cache.allocate(seq, 1)) == 1
    assert len(cache.block_ids("s")) == 3
    cache.free(seq)
    assert cache.block_ids("s") == [] and cache.pool.num_used_blocks == 0


def test_allocate_returns_none_and_changes_nothing_when_short():
    cache = KVCacheManager(num_blocks=3, block_size=4)
    big, small = make_seq("big", list(range(9))), make_seq("small", [1, 2])
    assert cache.allocate(big, 9, cache.find_prefix(big)) is not None  # 3 blocks
    assert cache.allocate(small, 2, cache.find_prefix(small)) is None
    assert cache.block_ids("small") == [] and cache.pool.num_used_blocks == 3


def test_prefix_hits_cover_computed_full_blocks_but_never_the_last_token():
    cache = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # 3 full blocks
    first = make_seq("first", prompt)
    cache.allocate(first, 12, cache.find_prefix(first))
    assert cache.find_prefix(make_seq("x", prompt + [1])).num_tokens == 0  # nothing computed yet
    first.num_computed_tokens = 12
    cache.cache_computed_blocks(first)

    same = make_seq("same", prompt)
    hit = cache.find_prefix(same)
    assert hit.num_tokens == 8  # the third block holds the last token, which must run
    longer = make_seq("longer", prompt + [7, 8])
    hit_longer = cache.find_prefix(longer)
    assert hit_longer.num_tokens == 12
    assert [b.block_id for b in hit_longer.blocks] == cache.block_ids("first")
    other = make_seq("other", [100, 101, 102, 999] + prompt[4:] + [1])
    assert cache.find_prefix(other).num_tokens == 0  # first block differs: the chain breaks

    cache.allocate(longer, 2, hit_longer)
    assert cache.block_ids("longer")[:3] == cache.block_ids("first")
    assert all(cache.pool.blocks[i].ref_count == 2 for i in cache.block_ids("first"))
    assert cache.prefix_cache_queries == 12 + 14 and cache.prefix_cache_hits == 12


def test_freed_prompt_blocks_are_hit_later_and_salt_isolates_tenants():
    cache = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    a = make_seq("a", prompt, salt="tenant-a")
    cache.allocate(a, 9, cache.find_prefix(a))
    a.num_computed_tokens = 9
    cache.cache_computed_blocks(a)
    cache.free(a)
    assert cache.pool.num_used_blocks == 0

    assert cache.find_prefix(make_seq("a2", prompt, salt="tenant-a")).num_tokens == 8
    assert cache.find_prefix(make_seq("b", prompt, salt="tenant-b")).num_tokens == 0
    assert cache.find_prefix(make_seq("c", prompt)).num_tokens == 0


def test_hit_blocks_that_are_evictable_count_against_free_space():
    cache = KVCacheManager(num_blocks=3, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    cache.allocate(a, 5, cache.find_prefix(a))
    a.num_computed_tokens = 5
    cache.cache_computed_blocks(a)
    cache.free(a)  # 2 cached evictable blocks + 1 empty
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit = cache.find_prefix(b)
    assert hit.num_tokens == 4
    # b needs 5 blocks in all: 2 hit + 3 new, but taking the hits leaves only 1 free.
    assert cache.allocate(b, 5, hit) is None
    assert cache.pool.num_free_blocks == 3 and cache.pool.num_cached_blocks == 2


def test_prefix_caching_off_finds_nothing_and_keeps_no_hashes():
    cache = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    cache.allocate(a, 9, cache.find_prefix(a))
    a.num_computed_tokens = 9
    cache.cache_computed_blocks(a)
    cache.free(a)
    assert cache.find_prefix(make_seq("b", list(range(9)))).num_tokens == 0
    assert cache.pool.num_cached_blocks == 0 and cache.prefix_cache_queries == 0


# -- sizing from a memory budget -------------------------------------------------------------------
def test_cache_is_sized_from_the_budget():
    import torch

    from sits.runtime.config import CacheConfig, ConfigError
    from sits.runtime.engine.cache_sizing import (
        GIB,
        KVShape,
        MemoryProfile,
        check_fits_one_sequence,
        num_blocks_for_budget,
    )

    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    per_block = 2 * 30 * 16 * 3 * 64 * 4
    assert shape.bytes_per_block(16) == per_block
    cpu = torch.device("cpu")
    assert num_blocks_for_budget(CacheConfig(kv_cache_gb=1.0), shape, cpu) == GIB // per_block
    assert num_blocks_for_budget(CacheConfig(kv_cache_gb=1.0, num_blocks=7), shape, cpu) == 7

    cuda = torch.device("cuda")
    # 80 GiB card, 20 GiB resident, 2 GiB activation peak, 90 %: 72 - 20 - 2 = 50 GiB for KV.
    profile = MemoryProfile(total=80 * GIB, free=60 * GIB, activation_peak=2 * GIB)
    blocks = num_blocks_for_budget(CacheConfig(gpu_memory_utilization=0.9), shape, cuda, profile)
    assert blocks == int(80 * GIB * 0.9 - 22 * GIB) // per_block
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        num_blocks_for_budget(CacheConfig(gpu_memory_utilization=0.2), shape, cuda, profile)

    check_fits_one_sequence(num_blocks=4, block_size=16, max_model_len=64)
    with pytest.raises(ConfigError, match="max-model-len 65"):
        check_fits_one_sequence(num_blocks=4, block_size=16, max_model_len=65)
