"""The fair waiting queue inside the engine's real scheduler: a flood cannot starve a single request."""

from __future__ import annotations

from sits.runtime.config import SchedulerConfig
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.scheduler import Scheduler
from sits.runtime.engine.scheduler_output import ModelRunnerOutput, SampledToken
from sits.runtime.engine.sequence import Sequence
from sits.runtime.server.request_ids import new_request_id
from sits.runtime.tenancy.kv_policy import TenantEvictionPolicy
from sits.runtime.tenancy.tenants import Tenant, TenantTable
from sits.runtime.tenancy.waiting_queue import FairWaitingQueue

TABLE = TenantTable([Tenant("flooder", kv_cache_share=0.5), Tenant("victim", kv_cache_share=0.5)])


def make_scheduler(max_num_seqs: int, num_blocks: int = 256) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, True, TenantEvictionPolicy(num_blocks, TABLE))
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    return Scheduler(config, kv, max_model_len=128, waiting_queue=FairWaitingQueue(TABLE.weights()))


def sequence(tenant: str, n: int, prompt_len: int = 8, max_tokens: int = 3) -> Sequence:
    request_id = new_request_id("req")
    return Sequence(seq_id=request_id, request_id=request_id, index=0,
                    prompt_token_ids=[(n * 7 + i) % 500 + 1 for i in range(prompt_len)],
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens,
                    arrival_time=float(n), tenant=tenant, arrival_order=n,
                    cache_salt=Tenant(tenant).prefix_salt)


def step(scheduler: Scheduler, seen: set[str]) -> list[str]:
    """One engine step without a model (every sampling sequence gets token 7); returns the
    tenants of the sequences scheduled for the first time, in admission order."""
    output = scheduler.schedule()
    sampled = {s.seq_id: SampledToken(7) for s in output.scheduled if s.samples}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled=sampled))
    admitted = [s.sequence for s in output.scheduled if s.seq_id not in seen]
    seen.update(seq.seq_id for seq in admitted)
    return [seq.tenant for seq in admitted]


def test_a_single_request_is_admitted_within_one_round_of_a_flood():
    scheduler, seen = make_scheduler(max_num_seqs=2), set()
    for n in range(200):
        scheduler.add_request(sequence("flooder", n))
    assert step(scheduler, seen) == ["flooder", "flooder"]  # the flood fills the batch
    scheduler.add_request(sequence("victim", 1000))
    admitted = []
    for _ in range(6):
        admitted += step(scheduler, seen)
        if "victim" in admitted:
            break
    # As soon as a slot frees, the victim's request is next: at most one flood request before it.
    assert "victim" in admitted and admitted.index("victim") <= 1


def test_the_default_fcfs_queue_would_starve_it():
    """The same workload with the engine's default queue: the victim waits behind the flood."""
    kv = KVCacheManager(256, 4, True, TenantEvictionPolicy(256, TABLE))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv, max_model_len=128)
    seen: set[str] = set()
    for n in range(200):
        scheduler.add_request(sequence("flooder", n))
    step(scheduler, seen)
    scheduler.add_request(sequence("victim", 1000))
    admitted = []
    for _ in range(6):
        admitted += step(scheduler, seen)
    assert "victim" not in admitted


def test_weights_share_admissions_between_backlogged_tenants():
    table = TenantTable([Tenant("a", weight=3.0), Tenant("b", weight=1.0)])
    kv = KVCacheManager(1024, 4, True, TenantEvictionPolicy(1024, table))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, max_model_len=128,
                          waiting_queue=FairWaitingQueue(table.weights()))
    seen: set[str] = set()
    for n in range(100):
        scheduler.add_request(sequence("a", n))
        scheduler.add_request(sequence("b", 1000 + n))
    admitted = []
    while len(admitted) < 40:
        admitted += step(scheduler, seen)
    first = admitted[:40]
    assert abs(first.count("a") - 30) <= 2
