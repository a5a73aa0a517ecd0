"""The host-memory KV tier (--host-kv-cache-gb): evicted cached blocks go to host memory and prefix
hits there come back, bit-exact, with per-tenant hostKvCacheShare quotas and tenant isolation.

Bookkeeping and copies are tested on the real KVCacheManager / HostKVTier with small CPU tensors;
the end-to-end tests run the real engine on the tiny random Llama against an engine with no cache.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from sits.runtime.commands.engine_args import add_engine_arguments, engine_config_from_args
from sits.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.cache_sizing import KVShape
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.eviction import BlockOwner, KVBlock
from sits.runtime.engine.host_tier import HostKVTier, gpu_numa_node, parse_cpulist
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.prefix_hash import hash_block
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.sequence import Sequence
from sits.runtime.parallel.config import ParallelConfig
from sits.runtime.server.metrics import EngineStatsCollector
from sits.runtime.tenancy.host_kv_policy import host_tenant_eviction_policy
from sits.runtime.tenancy.tenants import Tenant, TenantConfigError, TenantTable, parse_tenants

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 4
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def make_seq(seq_id: str, tokens: list[int], *, tenant: str = "default", salt: str | None = None,
             lora: str | None = None) -> Sequence:
    return Sequence(seq_id, seq_id, 0, list(tokens), SamplingParams(), max_tokens=4, arrival_time=0.0,
                    tenant=tenant, cache_salt=salt, lora_name=lora)


def random_caches(num_blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, SHAPE.num_kv_heads, SHAPE.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(SHAPE.num_layers)]


def block_kv(caches, block_id: int) -> list[torch.Tensor]:
    return [t[block_id].clone() for k, v in caches for t in (k, v)]


def compute(kv: KVCacheManager, seq: Sequence, prefix=None) -> list[int]:
    """Admit `seq` (all its tokens computed at once) and make its full blocks findable."""
    prefix = prefix if prefix is not None else kv.find_prefix(seq)
    ids = kv.allocate(seq, seq.num_tokens - prefix.num_tokens, prefix)
    assert ids is not None
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_computed_blocks(seq)
    return kv.block_ids(seq.seq_id)


# -- the mechanism, on the KV-cache manager -----------------------------------------------------------
def test_an_evicted_block_is_offloaded_and_comes_back_bit_exact_from_the_host():
    tier = HostKVTier(8, SHAPE, BLOCK, torch.device("cpu"))
    kv = KVCacheManager(4, BLOCK, host_tier=tier)
    caches = random_caches(4, seed=0)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks can hit
    first = make_seq("a1", prompt)
    table = compute(kv, first)
    original = [block_kv(caches, block_id) for block_id in table[:3]]
    kv.free(first)
    other = make_seq("b", list(range(200, 216)))
    compute(kv, other)  # 4 blocks: takes the empty one, then evicts a1's three cached blocks
    assert tier.stats().offload_blocks == 0
    assert all(tier.lookup(h) is None for h in first.block_hashes[:3])  # not findable before the copy ran
    tier.run_transfers(caches)  # the next step: copies out before its forward overwrites the blocks
    for k, v in caches:  # b's forward writes its blocks
        k.normal_()
        v.normal_()
    kv.free(other)
    again = make_seq("a2", prompt)
    hit = kv.find_prefix(again)
    assert (hit.blocks, len(hit.host_blocks), hit.num_tokens) == ([], 3, 12)
    new_ids = kv.allocate(again, 1, hit)
    assert new_ids is not None and len(new_ids) == 4
    tier.run_transfers(caches)
    for block_id, expected in zip(new_ids[:3], original, strict=True):
        for got, want in zip(block_kv(caches, block_id), expected, strict=True):
            assert torch.equal(got, want)
    stats = tier.stats()
    assert (stats.offload_blocks, stats.onload_blocks) == (3 + 4, 3)  # a2's allocation evicted b's 4 blocks
    assert stats.offload_bytes == 7 * SHAPE.bytes_per_block(BLOCK)
    assert kv.prefix_cache_hits == kv.prefix_cache_host_hits == 12
    assert kv.prefix_counts["default"].host_hits == 12
    assert tier.pool.num_used_blocks == 0  # the onload's references went back with its copy


def test_host_hits_continue_a_gpu_hit_run_and_are_held_against_the_evictions_of_their_own_allocation():
    tier = HostKVTier(3, SHAPE, BLOCK, torch.device("cpu"))  # room for exactly the three blocks
    kv = KVCacheManager(5, BLOCK, host_tier=tier)
    caches = random_caches(5, seed=1)
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks can hit
    first = make_seq("a1", prompt)
    compute(kv, first)
    kv.free(first)  # the tail is released first: evicted first
    compute(kv, other := make_seq("b", list(range(300, 311))))  # 3 blocks: the empty one, then a1's tail two
    tier.run_transfers(caches)
    kv.free(other)
    again = make_seq("a2", prompt)
    hit = kv.find_prefix(again)
    assert (len(hit.blocks), len(hit.host_blocks)) == (2, 2)
    # Allocating a2's blocks evicts b's (uncached: empty) and then cached blocks, whose offload must
    # not take the two host blocks a2 is about to read.
    assert kv.allocate(again, 1, hit) is not None
    assert all(block.ref_count == 1 for block in hit.host_blocks)
    tier.run_transfers(caches)
    assert all(block.ref_count == 0 and block.block_hash is not None for block in hit.host_blocks)


def test_a_hash_evicted_again_while_its_copy_is_in_flight_is_copied_once():
    tier = HostKVTier(4, SHAPE, BLOCK, torch.device("cpu"))
    block_hash = hash_block(None, [1, 2, 3, 4])
    for block_id in (0, 1):  # the same prefix, computed again into another GPU block and evicted again
        tier.offload(KVBlock(block_id=block_id, block_hash=block_hash, last_owner=BlockOwner("r")), "default")
    assert tier.pool.num_used_blocks == 1
    tier.run_transfers(random_caches(4, seed=5))
    assert tier.lookup(block_hash) is not None and tier.stats().offload_blocks == 1


def test_a_tenant_never_hits_another_tenants_or_another_adapters_host_blocks():
    tier = HostKVTier(8, SHAPE, BLOCK, torch.device("cpu"))
    kv = KVCacheManager(4, BLOCK, host_tier=tier)
    caches = random_caches(4, seed=2)
    prompt = list(range(100, 113))
    owner = make_seq("a1", prompt, tenant="acme", salt="salt-acme")
    compute(kv, owner)
    kv.free(owner)
    compute(kv, evictor := make_seq("b", list(range(200, 216)), tenant="acme", salt="salt-acme"))
    tier.run_transfers(caches)
    kv.free(evictor)
    assert len(kv.find_prefix(make_seq("same", prompt, tenant="acme", salt="salt-acme")).host_blocks) == 3
    assert kv.find_prefix(make_seq("other", prompt, tenant="globex", salt="salt-globex")).num_tokens == 0
    assert kv.find_prefix(make_seq("unsalted", prompt)).num_tokens == 0
    assert kv.find_prefix(make_seq("adapter", prompt, tenant="acme", salt="salt-acme", lora="sql")).num_tokens == 0
    assert all(counts.cross_tenant_hits == 0 for counts in kv.prefix_counts.values())


# -- quotas ------------------------------------------------------------------------------------------
def offload(tier: HostKVTier, tenant: str, index: int) -> None:
    block = KVBlock(block_id=index % 4, block_hash=hash_block(None, [index], (tenant,)),
                    last_owner=BlockOwner(f"{tenant}-{index}", tenant=tenant))
    tier.offload(block, tenant)


def test_host_shares_guarantee_each_tenant_its_blocks_and_borrowing_takes_only_the_unguaranteed():
    table = TenantTable([Tenant("acme", host_kv_cache_share=0.5), Tenant("globex", host_kv_cache_share=0.25)],
                        requires_auth=False)
    tier = HostKVTier(8, SHAPE, BLOCK, torch.device("cpu"), host_tenant_eviction_policy(8, table))
    caches = random_caches(4, seed=3)
    for index in range(10):  # acme: its 4 guaranteed blocks + the 2 nobody is guaranteed, never globex's 2
        offload(tier, "acme", index)
        tier.run_transfers(caches)
    assert tier.stats().blocks_by_tenant == {"acme": 6}
    for index in range(3):  # globex reaches its guarantee at once, then takes acme's borrowed blocks
        offload(tier, "globex", 100 + index)
        tier.run_transfers(caches)
    assert tier.stats().blocks_by_tenant == {"acme": 5, "globex": 3}
    # acme's newest blocks stayed: it gave up its oldest (lowest score) first
    assert tier.lookup(hash_block(None, [9], ("acme",))) is not None
    assert tier.lookup(hash_block(None, [0], ("acme",))) is None
    for index in range(20, 30):  # acme again: it may only evict its own blocks, globex is within share
        offload(tier, "acme", index)
        tier.run_transfers(caches)
    assert tier.stats().blocks_by_tenant["globex"] >= 2


def test_a_tenant_with_no_host_share_and_a_full_tier_drops_its_blocks():
    table = TenantTable([Tenant("acme", host_kv_cache_share=1.0), Tenant("guest")], requires_auth=False)
    tier = HostKVTier(4, SHAPE, BLOCK, torch.device("cpu"), host_tenant_eviction_policy(4, table))
    offload(tier, "guest", 1)
    tier.run_transfers(random_caches(4, seed=4))
    stats = tier.stats()
    assert (stats.blocks_cached, stats.dropped_blocks) == (0, 1)


def test_tenants_file_takes_host_kv_cache_share_and_checks_its_sum():
    table = parse_tenants({"tenants": [{"name": "a", "hostKvCacheShare": 0.6}, {"name": "b"}]}, require_keys=False)
    assert table.host_shares() == {"a": 0.6, "b": 0.0}
    assert table.to_document()["tenants"][0]["hostKvCacheShare"] == 0.6
    with pytest.raises(TenantConfigError, match="hostKvCacheShare values sum to 1.2"):
        parse_tenants({"tenants": [{"name": "a", "hostKvCacheShare": 0.6}, {"name": "b", "hostKvCacheShare": 0.6}]},
                      require_keys=False)
    with pytest.raises(TenantConfigError, match="hostKvCacheShare must be between 0 and 1"):
        parse_tenants({"tenants": [{"name": "a", "hostKvCacheShare": 2}]}, require_keys=False)


# -- flags -------------------------------------------------------------------------------------------
def test_the_flag_reaches_the_config_and_bad_values_are_config_errors():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", "m", "--device", "cpu", "--host-kv-cache-gb", "2.5"])
    assert engine_config_from_args(args).cache.host_kv_cache_gb == 2.5
    assert engine_config_from_args(parser.parse_args(["--model", "m", "--device", "cpu"])).cache.host_kv_cache_gb == 0
    with pytest.raises(ConfigError, match="--host-kv-cache-gb must be >= 0"):
        CacheConfig(host_kv_cache_gb=-1).validate()
    with pytest.raises(ConfigError, match="needs prefix caching"):
        CacheConfig(host_kv_cache_gb=1, enable_prefix_caching=False).validate()
    with pytest.raises(ConfigError, match="--host-kv-cache-gb does not run with --tensor-parallel-size > 1"):
        EngineConfig(cache=CacheConfig(host_kv_cache_gb=1), parallel=ParallelConfig(tensor_parallel_size=2)).validate()


def test_numa_placement_reads_the_kernels_cpu_lists_and_needs_a_gpu():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()
    assert gpu_numa_node(torch.device("cpu")) is None


# -- the engine, end to end --------------------------------------------------------------------------
def engine_config(host_blocks: int, *, prefix: bool = True, async_scheduling: bool = False,
                  batched_tokens: int = 256) -> EngineConfig:
    loaded_shape_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # the tiny Llama: 2 layers, 2 KV heads, head dim 16, float32
    return EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=96),
                        cache=CacheConfig(block_size=BLOCK, num_blocks=24, enable_prefix_caching=prefix,
                                          host_kv_cache_gb=host_blocks * loaded_shape_bytes / (1 << 30)),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=batched_tokens),
                        async_scheduling=async_scheduling)


GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


def run_one(engine: LLMEngine, request_id: str, prompt: list[int], **kwargs) -> list[int]:
    engine.add_request(request_id, prompt, GREEDY, **kwargs)
    for _ in range(200):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.outputs[0].token_ids
    raise AssertionError(f"{request_id} did not finish")


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny) -> LLMEngine:
    return LLMEngine.from_loaded(tiny, engine_config(0, prefix=False))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_output_with_a_host_hit_is_token_identical_to_no_cache(tiny, reference, async_scheduling):
    long_prompt, filler = prompts(0, 41, 60)
    expected = run_one(reference, "ref", long_prompt)
    engine = LLMEngine.from_loaded(tiny, engine_config(64, async_scheduling=async_scheduling))
    assert engine.runner.host_tier is not None and engine.runner.host_tier.num_blocks == 64
    assert run_one(engine, "first", long_prompt) == expected
    run_one(engine, "filler", filler)  # pushes the first prompt's blocks out of the GPU cache
    before = engine.stats()
    assert before.host_kv is not None and before.host_kv.offload_blocks > 0
    assert run_one(engine, "again", long_prompt) == expected
    after = engine.stats()
    host_hits = after.prefix_cache_host_hits - before.prefix_cache_host_hits
    assert host_hits >= 4 * BLOCK and after.host_kv.onload_blocks * BLOCK >= host_hits


def test_preemption_with_the_host_tier_keeps_every_output_identical(tiny, reference):
    batch = prompts(1, 41, 37, 45)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    expected = {}
    for index, prompt in enumerate(batch):
        reference.add_request(f"ref-{index}", prompt, params)
        while reference.has_unfinished_requests():
            expected.update({o.request_id: o.outputs[0].token_ids for o in reference.step() if o.finished})
    engine = LLMEngine.from_loaded(tiny, engine_config(64))
    for round_ in range(2):  # the second round finds the first's blocks on the GPU or the host
        for index, prompt in enumerate(batch):
            engine.add_request(f"r{round_}-{index}", prompt, params)
        got = {}
        while engine.has_unfinished_requests():
            got.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        for index in range(len(batch)):
            assert got[f"r{round_}-{index}"] == expected[f"ref-{index}"]
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.host_kv.offload_blocks > 0
    assert engine.kv_cache.pool.num_used_blocks == 0 and engine.runner.host_tier.pool.num_used_blocks == 0


def test_an_abort_while_host_blocks_are_copied_back_leaves_both_pools_consistent(tiny, reference):
    long_prompt, filler = prompts(2, 57, 60)
    expected = run_one(reference, "ref-abort", long_prompt)
    engine = LLMEngine.from_loaded(tiny, engine_config(64, batched_tokens=16))  # prefill in chunks
    run_one(engine, "first", long_prompt)
    run_one(engine, "filler", filler)
    hits_before = engine.stats().prefix_cache_host_hits
    engine.add_request("aborted", long_prompt, GREEDY)
    engine.step()  # admitted with its host hits: their copy back and its first chunk ran
    assert engine.stats().prefix_cache_host_hits > hits_before
    engine.abort_request("aborted")
    engine.step()
    assert engine.kv_cache.pool.num_used_blocks == 0
    assert engine.runner.host_tier.pool.num_used_blocks == 0
    assert run_one(engine, "after", long_prompt) == expected


def test_tenants_prompts_are_isolated_in_the_host_tier_end_to_end(tiny):
    long_prompt, filler = prompts(3, 41, 60)
    engine = LLMEngine.from_loaded(tiny, engine_config(64))
    run_one(engine, "acme-1", long_prompt, tenant="acme", cache_salt="salt-acme")
    run_one(engine, "filler", filler, tenant="acme", cache_salt="salt-acme")
    run_one(engine, "globex-1", long_prompt, tenant="globex", cache_salt="salt-globex")
    counts = engine.stats().prefix_cache_by_tenant
    assert counts["globex"].hits == 0 and counts["globex"].cross_tenant_hits == 0


def test_metrics_show_hits_by_tier_and_the_host_tiers_blocks_and_copies(tiny):
    long_prompt, filler = prompts(4, 41, 60)
    engine = LLMEngine.from_loaded(tiny, engine_config(64))
    run_one(engine, "first", long_prompt)
    run_one(engine, "filler", filler)
    run_one(engine, "again", long_prompt)
    stats = engine.stats()
    samples = {}
    for family in EngineStatsCollector(engine.stats, "tiny", "stable").collect():
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model": "tiny", "track": "stable", **labels}.items())))]

    host = value("sits_prefix_cache_tier_hits_total", tenant="default", tier="host")
    gpu = value("sits_prefix_cache_tier_hits_total", tenant="default", tier="gpu")
    assert host == stats.prefix_cache_host_hits > 0
    assert host + gpu == value("sits_prefix_cache_hits_total", tenant="default") == stats.prefix_cache_hits
    assert value("sits_kv_host_blocks_used", tenant="default") == stats.host_kv.blocks_by_tenant["default"] > 0
    assert value("sits_kv_host_blocks_total") == 64
    assert value("sits_kv_host_offload_bytes_total") == stats.host_kv.offload_bytes > 0
    assert value("sits_kv_host_onload_bytes_total") == stats.host_kv.onload_bytes > 0
    assert value("sits_kv_host_onload_seconds_total") > 0


def test_a_host_tier_too_small_for_one_block_is_refused(tiny):
    config = engine_config(0)
    config.cache.host_kv_cache_gb = 1e-9
    with pytest.raises(ConfigError, match="holds no KV block"):
        LLMEngine.from_loaded(tiny, config)
