"""Two real `sits serve` processes sharing one real Redis: one tenant's RPM holds across both, and
killing Redis mid-load fails no request; when Redis returns, each replica writes its state back."""

from __future__ import annotations

import contextlib
import hashlib
import math
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from sits.operator.tenancy_sync import sync_tenant_table
from sits.operator.tenants import TenantRecord
from tests.support.services import RunningService, free_port, redis_server, started

DEPLOYMENT = "llm.replicas"
FINANCE, METERED = "sk-finance-1d9a", "sk-metered-77c4"
RPM = 6
TENANTS_YAML = f"""
tenants:
  - {{name: finance, apiKey: "{FINANCE}", priority: 3, kvCacheShare: 0.5}}
  - {{name: metered, apiKey: "{METERED}", requestsPerMinute: {RPM}}}
"""


@dataclass
class Cluster:
    redis_port: int
    redis: RunningService
    replicas: list[RunningService] = field(default_factory=list)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port, decode_responses=True, socket_timeout=2)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def serve_argv(model_dir, port: int, tenants_file, redis_port: int) -> list[str]:
    return [sys.executable, "-m", "sits.runtime", "serve", "--model", str(model_dir), "--served-model-name", "tiny",
            "--device", "cpu", "--port", str(port), "--num-blocks", "64", "--max-model-len", "256",
            "--max-num-seqs", "8", "--tenants", str(tenants_file), "--state-store",
            f"redis://127.0.0.1:{redis_port}/0", "--deployment", DEPLOYMENT, "--log-level", "info",
            "--metrics-port", str(free_port())]  # with tenants, /metrics is not on the API port


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory) -> Iterator[Cluster]:
    tenants_file = tmp_path_factory.mktemp("replicas") / "tenants.yaml"
    tenants_file.write_text(TENANTS_YAML)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(redis_server())
        cluster = Cluster(store.port, store)
        for _ in range(2):
            port = free_port()
            replica = stack.enter_context(started(serve_argv(tiny_llama_dir, port, tenants_file, store.port), port,
                                                  timeout_s=120, log_name="serve.log"))
            wait_until(lambda r=replica: httpx.get(f"{r.url}/health").status_code == 200, 120, "a ready replica")
            cluster.replicas.append(replica)
        yield cluster


def complete(url: str, key: str, client: httpx.Client | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 2}
    return (client or httpx).post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                  timeout=30)


def metric(replica: RunningService, name: str, **labels: str) -> float:
    total = 0.0
    argv = list(replica.process.args)
    metrics_url = f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}/metrics"
    for family in text_string_to_metric_families(httpx.get(metrics_url).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_two_replicas_enforce_one_tenants_requests_per_minute(cluster):
    if time.time() % 60 > 50:  # keep the burst inside one rate window
        time.sleep(61 - time.time() % 60)
    window = math.floor(time.time() / 60)
    responses = [complete(cluster.replicas[i % 2].url, METERED) for i in range(2 * RPM)]
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == RPM and statuses.count(429) == RPM  # not RPM per replica
    assert {200} <= {r.status_code for r in responses[0::2]} and {200} <= {r.status_code for r in responses[1::2]}
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and int(refused.headers["retry-after"]) >= 1
    assert sum(metric(r, "sits_rate_limited_total", tenant="metered") for r in cluster.replicas) == RPM
    counts = cluster.client().hgetall(f"sits:{DEPLOYMENT}:rl:metered:{window}")
    assert sum(int(v) for k, v in counts.items() if k.startswith("r:")) == RPM


def test_the_operator_updates_tenants_live_through_redis(cluster):
    newcomer_key = "sk-newcomer-5b2e"
    digest = hashlib.sha256
    records = [TenantRecord("finance", digest(FINANCE.encode()).hexdigest(), priority=3, kv_cache_share=0.5),
               TenantRecord("metered", digest(METERED.encode()).hexdigest(), requests_per_minute=RPM),
               TenantRecord("newcomer", digest(newcomer_key.encode()).hexdigest(), kv_cache_share=0.2)]
    namespace, name = DEPLOYMENT.split(".")
    assert all(complete(r.url, newcomer_key).status_code == 401 for r in cluster.replicas)
    result = sync_tenant_table(f"redis://127.0.0.1:{cluster.redis_port}/0", namespace, name, records)
    assert result.synced, result.message
    # Each replica polls the table's version every 2 s and swaps the new table in.
    wait_until(lambda: all(complete(r.url, newcomer_key).status_code == 200 for r in cluster.replicas), 15,
               "the new tenant's key accepted by both replicas")
    assert all(metric(r, "sits_kv_blocks_guaranteed", tenant="newcomer") == 12 for r in cluster.replicas)


class Load:
    """One client thread per replica sending finance requests until stopped; every status is kept."""

    def __init__(self, replicas: list[RunningService]) -> None:
        self.statuses: list[list[int | str]] = [[] for _ in replicas]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(r.url, i), daemon=True)
                         for i, r in enumerate(replicas)]

    def _run(self, url: str, index: int) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                try:
                    self.statuses[index].append(complete(url, FINANCE, client).status_code)
                except httpx.HTTPError as error:
                    self.statuses[index].append(type(error).__name__)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def served(self) -> int:
        return sum(len(s) for s in self.statuses)


def store_up(replica: RunningService) -> float:
    return metric(replica, "sits_state_store_up")


def test_redis_killed_mid_load_fails_no_request_and_the_state_returns(cluster):
    replicas = cluster.replicas
    window = math.floor(time.time() / 60)
    metered = complete(replicas[0].url, METERED)  # counts in the shared window of this minute
    with Load(replicas) as load:
        wait_until(lambda: load.served() >= 6, 30, "load before the outage")
        cluster.redis.kill()
        wait_until(lambda: all(store_up(r) == 0 for r in replicas), 15, "sits_state_store_up 0 on both replicas")
        during = load.served()
        wait_until(lambda: load.served() >= during + 6, 30, "requests served while Redis is down")
        with redis_server(cluster.redis_port) as restarted:
            wait_until(lambda: all(store_up(r) == 1 for r in replicas), 30, "sits_state_store_up 1 again")
            after = load.served()
            wait_until(lambda: load.served() >= after + 4, 30, "requests after Redis returned")
            load.__exit__()
            assert [s for statuses in load.statuses for s in statuses if s != 200] == []
            # Redis came back empty (no persistence): each replica wrote its state back.
            client = cluster.client()
            prefix = f"sits:{DEPLOYMENT}:"
            replica_ids = set(client.hkeys(prefix + "replicas"))
            assert len(replica_ids) == 2
            served = sum(s == 200 for statuses in load.statuses for s in statuses)

            def finance_requests_in_redis() -> int:
                return sum(int(client.hget(f"{prefix}usage:{r}", "finance|requests") or 0) for r in replica_ids)

            wait_until(lambda: finance_requests_in_redis() == served, 10, "usage written back")
            table = client.hgetall(prefix + "tenants")
            assert int(table["version"]) >= 1 and '"name": "metered"' in table["document"]
            assert FINANCE not in table["document"]  # digests only
            for replica_id in replica_ids:
                assert "finance" in client.hgetall(f"{prefix}eviction:{replica_id}")
            if metered.status_code == 200 and math.floor(time.time() / 60) - window <= 1:
                assert client.hgetall(f"{prefix}rl:metered:{window}")  # the shared rate window is back too
            # Read the logs while Redis is still up: stopping it below is a second outage, which is logged again.
            for replica in replicas:
                log = (replica.workdir / "serve.log").read_text()
                assert log.count("is unreachable") == 1  # logged once per outage
                assert FINANCE not in log and METERED not in log
            restarted.stop()
