"""The tenancy layer inside the real engine (tiny random Llama, real steps): the fair queue skips a
tenant whose shard is full, a flood does not delay another tenant's request by more than a round,
and preemption spares tenants within their guarantee, lowest priority first."""

from __future__ import annotations

import time

import pytest

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.errors import PromptTooLongError
from sits.runtime.engine.request import SamplingParams
from sits.runtime.models.loading import load_model
from sits.runtime.server.request_ids import new_request_id
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.memory_store import MemoryStateStore
from sits.runtime.tenancy.request_ids import RequestIdGenerator
from sits.runtime.tenancy.service import Tenancy
from sits.runtime.tenancy.tenants import Tenant, TenantTable
from tests.tenancy.recording_policy import RecordingPolicy

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    config = ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=64)
    return load_model(config, TorchAttentionBackend(), progress=False)


def make_engine(tiny, table: TenantTable, num_blocks: int, max_seqs: int = 8, tenancy: bool = True) -> LLMEngine:
    """An engine over the tiny model; with tenancy its hooks (shards, scores, fair queue), else the
    engine's own defaults (FCFS queue, LRU eviction, preemption by priority only)."""
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=min(64, num_blocks * BLOCK)),
                          cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=256))
    if not tenancy:
        return LLMEngine.from_loaded(tiny, config)
    hooks = Tenancy(TenancyConfig(), table, MemoryStateStore()).engine_hooks()
    return LLMEngine.from_loaded(tiny, config, **hooks)


def submit(engine: LLMEngine, table: TenantTable, tenant: str, prompt_len: int, max_tokens: int,
           first_token: int = 100) -> str:
    """A request as the server hands it over: the tenant's priority and prefix-cache salt."""
    request_id = new_request_id("req")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    engine.add_request(request_id, list(range(first_token, first_token + prompt_len)), params, tenant=tenant,
                       priority=table.get(tenant).priority, cache_salt=table.prefix_salt(table.get(tenant)))
    return request_id


def running_ids(engine: LLMEngine) -> set[str]:
    return {seq.request_id for seq in engine.scheduler.running}


def test_a_tenant_at_its_share_does_not_hold_up_another_tenants_request(tiny):
    # a's higher priority puts its waiting head first in service order; its shard is full, so b's
    # request goes ahead instead of waiting behind it.
    table = TenantTable([Tenant("a", priority=3, kv_cache_share=0.5), Tenant("b", kv_cache_share=0.5)])
    engine = make_engine(tiny, table, num_blocks=8)
    first = submit(engine, table, "a", prompt_len=3 * BLOCK, max_tokens=4)  # a's whole share: 4 blocks
    engine.step()
    submit(engine, table, "a", prompt_len=2 * BLOCK, max_tokens=4)  # waits: a is at its share
    other = submit(engine, table, "b", prompt_len=2 * BLOCK, max_tokens=4, first_token=500)
    engine.step()
    assert running_ids(engine) == {first, other}  # b went ahead of a's waiting head
    assert engine.stats().waiting_by_tenant == {"a": 1}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_finished == 3


def test_a_flood_delays_another_tenants_request_by_at_most_one_round(tiny):
    table = TenantTable([Tenant("flood"), Tenant("single")])
    engine = make_engine(tiny, table, num_blocks=64, max_seqs=2)
    flood = [submit(engine, table, "flood", prompt_len=6, max_tokens=3, first_token=10 * i) for i in range(10)]
    engine.step()
    engine.step()
    single = submit(engine, table, "single", prompt_len=6, max_tokens=3, first_token=900)
    admitted: list[str] = []
    while engine.has_unfinished_requests():
        before = running_ids(engine)
        engine.step()
        admitted += sorted(running_ids(engine) - before)
    waiting_flood_at_arrival = [r for r in flood if r in admitted]
    assert len(waiting_flood_at_arrival) >= 6  # most of the flood was still queued when `single` came
    assert admitted.index(single) <= 1  # at most one more flood request went first


def test_a_request_longer_than_its_tenant_can_hold_is_refused_or_shortened(tiny):
    # b may hold 4 of the 16 blocks (its guarantee; a's 12 are a's): 16 tokens of KV cache.
    table = TenantTable([Tenant("a", kv_cache_share=0.75), Tenant("b", kv_cache_share=0.25)])
    engine = make_engine(tiny, table, num_blocks=16)
    with pytest.raises(PromptTooLongError, match="tenant 'b' can hold at most 16 tokens"):
        submit(engine, table, "b", prompt_len=10, max_tokens=8)  # would wait for blocks forever
    open_ended = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    engine.add_request("open", list(range(100, 110)), open_ended, tenant="b", cache_salt="b")
    lengths = drive(engine)
    assert lengths["open"] == 6  # stopped at its tenant's room (finish_reason length), not stuck


def drive(engine: LLMEngine) -> dict[str, int]:
    """Run every request to completion; output tokens per request."""
    lengths: dict[str, int] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                lengths[output.request_id] = len(output.outputs[0].token_ids)
    assert not engine.has_unfinished_requests()
    return lengths


def squeeze(engine: LLMEngine, table: TenantTable) -> dict[str, int]:
    """gold and bronze grow past what is free while silver stays within its guarantee; returns
    preemptions per tenant."""
    submit(engine, table, "gold", prompt_len=3 * BLOCK, max_tokens=20, first_token=100)
    submit(engine, table, "silver", prompt_len=2, max_tokens=14, first_token=300)
    submit(engine, table, "bronze", prompt_len=3 * BLOCK, max_tokens=20, first_token=500)
    lengths = drive(engine)
    assert sorted(lengths.values()) == [14, 20, 20]  # everyone finishes, preempted or not
    return engine.stats().preemptions_by_tenant


def test_preemption_spares_tenants_within_their_guarantee_and_takes_the_lowest_priority(tiny):
    table = TenantTable([Tenant("gold", priority=3, kv_cache_share=0.25),
                         Tenant("silver", priority=0, kv_cache_share=0.25),
                         Tenant("bronze", priority=1, kv_cache_share=0.0)])
    preempted = squeeze(make_engine(tiny, table, num_blocks=16), table)
    # silver has the lowest priority but holds no more than its guarantee: never a victim. bronze
    # borrows, and ranks below gold: it gives way when gold needs a block.
    assert preempted.get("silver", 0) == 0
    assert preempted.get("bronze", 0) >= 1
    # The same squeeze without shards preempts by priority alone: silver goes first.
    assert squeeze(make_engine(tiny, table, num_blocks=16, tenancy=False), table).get("silver", 0) >= 1


def test_eviction_order_through_the_engine_follows_the_score(tiny):
    """Finished requests leave their prompt blocks cached; a prompt needing the whole cache evicts
    them all, lowest t x (1 + 0.2 x priority) first, t read from each request's UUIDv7."""
    table = TenantTable([Tenant("gold", priority=3), Tenant("bronze", priority=0)])
    engine_start = time.time() - 1000.0
    policies: list[RecordingPolicy] = []

    def policy(num_blocks: int) -> RecordingPolicy:
        policies.append(RecordingPolicy(num_blocks, table, engine_start=engine_start))
        return policies[0]

    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=64),
                          cache=CacheConfig(block_size=BLOCK, num_blocks=16),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    engine = LLMEngine.from_loaded(tiny, config, eviction_policy=policy)
    script = [("gold", 100.0), ("bronze", 200.0), ("gold", 300.0), ("bronze", 400.0), ("bronze", 600.0),
              ("gold", 500.0)]
    blocks_of: dict[int, float] = {}
    for index, (tenant, t) in enumerate(script):
        when_ns = int((engine_start + t) * 1e9)
        request_id = RequestIdGenerator(clock_ns=lambda when_ns=when_ns: when_ns).new()
        params = SamplingParams(temperature=0.0, max_tokens=1)
        prompt = list(range(1000 + 20 * index, 1000 + 20 * index + 2 * BLOCK + 1))  # 2 full blocks to cache
        engine.add_request(request_id, prompt, params, tenant=tenant, priority=table.get(tenant).priority,
                           cache_salt=table.prefix_salt(table.get(tenant)))
        engine.step()  # prefill and sample: finished, its 2 full blocks stay cached
        score = t * (1 + 0.2 * table.get(tenant).priority)
        blocks_of.update({block.block_id: score for block in engine.kv_cache.pool.blocks
                          if block.block_hash is not None and block.block_id not in blocks_of})
    assert len(blocks_of) == 12 and not engine.has_unfinished_requests()
    submit(engine, table, "bronze", prompt_len=16 * BLOCK - 1, max_tokens=1, first_token=5000)  # all 16 blocks
    drive(engine)
    recording = policies[0]
    assert len(recording.victims) == 12
    scores = [blocks_of[block] for block in recording.victims]
    assert scores == sorted(scores)
    # gold's priority keeps its t=300 blocks (score 480) longer than bronze's younger t=400 ones.
    assert scores == [160.0] * 2 + [200.0] * 2 + [400.0] * 2 + [480.0] * 2 + [600.0] * 2 + [800.0] * 2
    assert recording.evictions_total == {"gold": 6, "bronze": 6}
