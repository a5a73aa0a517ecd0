"""`sits router` in front of two real `sits serve` replicas (a small random Llama with SmolLM2's
tokenizer) sharing a real Redis, driven with the official `openai` client. Replica 0 serves the
canary track and the router sends tenant bob there (`--canary-tenants bob`), everyone else to the
stable replica 1.

The tests share one cluster and run in file order: the last ones restart Redis and kill a replica.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.support.services import RunningService, free_port, redis_argv, started

DEPLOYMENT = "llm.routed"
ALICE, BOB = "sk-router-alice-7f3c91", "sk-router-bob-2d8e44"
TENANTS_YAML = f"""
tenants:
  - {{name: alice, apiKey: "{ALICE}", kvCacheShare: 0.4}}
  - {{name: bob, apiKey: "{BOB}", kvCacheShare: 0.4}}
"""
SYSTEM = ("You are the billing assistant of Alpine Outfitters. Answer questions about invoices, refunds, "
          "shipping fees and loyalty points politely and in two sentences at most. ") * 2


@dataclass
class Cluster:
    redis_port: int
    tenants_file: Path
    workdir: Path
    redis: RunningService | None = None
    replicas: list[RunningService] = field(default_factory=list)
    router: RunningService | None = None
    metrics_port: int = field(default_factory=lambda: free_port())  # every replica's --metrics-port

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def client(self, key: str = ALICE) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def store(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port, decode_responses=True, socket_timeout=2)


def metrics_base(replica: RunningService, cluster: Cluster) -> str:
    """Where a replica serves /metrics: its --metrics-port (with --tenants, not on the API port)."""
    return f"http://{replica.host}:{cluster.metrics_port}"


def metrics_url(replica: RunningService, cluster: Cluster) -> str:
    return f"{metrics_base(replica, cluster)}/metrics"


def wait_until(predicate, timeout_s: float, what: str):
    """Poll `predicate` every 0.1 s until it is truthy; returns that value, so a caller acts on the
    sample it waited for rather than on a second read that may differ."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def samples(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def serve_argv(model_dir: Path, host: str, port: int, cluster: Cluster, track: str) -> list[str]:
    return [sys.executable, "-m", "sits.runtime", "serve", "--track", track, "--model", str(model_dir), "--served-model-name", "tiny",
            "--device", "cpu", "--host", host, "--port", str(port), "--metrics-port", str(cluster.metrics_port),
            "--num-blocks", "96", "--max-model-len", "512",
            "--max-num-seqs", "8", "--tenants", str(cluster.tenants_file), "--state-store",
            f"redis://127.0.0.1:{cluster.redis_port}/0", "--deployment", DEPLOYMENT]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("router")
    tenants_file = workdir / "tenants.yaml"
    tenants_file.write_text(TENANTS_YAML)
    cluster = Cluster(free_port(), tenants_file, workdir)
    with contextlib.ExitStack() as stack:
        cluster.redis = stack.enter_context(started(redis_argv(cluster.redis_port), cluster.redis_port,
                                                    log_name="redis.log"))
        for index in range(2):
            # Each replica on its own loopback address, all with one --metrics-port (as pods share one).
            host, port = f"127.0.0.{index + 2}", free_port()
            argv = serve_argv(tiny_llama_dir, host, port, cluster, "canary" if index == 0 else "stable")
            replica = stack.enter_context(started(argv, port, timeout_s=120, workdir=workdir,
                                                  log_name=f"serve{index}.log", host=host))
            wait_until(lambda r=replica: httpx.get(f"{r.url}/health").status_code == 200, 120, "a ready replica")
            cluster.replicas.append(replica)
        port = free_port()
        argv = [sys.executable, "-m", "sits.runtime.router", "--port", str(port), "--state-store",
                f"redis://127.0.0.1:{cluster.redis_port}/0", "--deployment", DEPLOYMENT, "--tenants",
                str(tenants_file), "--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--policy", "precise",
                "--canary-tenants", "bob", "--replica-metrics-port", str(cluster.metrics_port),
                *[arg for r in cluster.replicas for arg in ("--replica", r.url)]]
        cluster.router = stack.enter_context(started(argv, port, timeout_s=60, workdir=workdir,
                                                     log_name="router.log"))
        wait_until(lambda: httpx.get(f"{cluster.url}/health").json()["replicas_up"] == 2, 30, "the router's pool")
        yield cluster


def chat(cluster: Cluster, user: str, key: str = ALICE, **options) -> str:
    reply = cluster.client(key).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        max_tokens=options.pop("max_tokens", 4), temperature=0, **options)
    return reply.choices[0].message.content or ""


def published(cluster: Cluster, replica: RunningService) -> int:
    """How many block hashes the replica has published to Redis."""
    replica_id = next(f.labels["replica_id"] for f in text_string_to_metric_families(
        httpx.get(metrics_url(replica, cluster)).text) for f in f.samples if f.name == "sits_state_store_replica")
    return cluster.store().scard(f"sits:{DEPLOYMENT}:kv:{replica_id}")


def test_a_bad_key_is_a_401_before_any_routing(cluster):
    before = samples(cluster.url, "sits_router_requests_total")
    with pytest.raises(openai.AuthenticationError) as caught:
        chat(cluster, "hello", key="sk-not-a-tenant")
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "invalid_request_error" and "message" in caught.value.body
    assert samples(cluster.url, "sits_router_requests_total") == before  # no replica was asked


def test_a_replicas_4xx_passes_through_unchanged(cluster):
    body = {"model": "no-such-model", "prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {ALICE}"}
    direct = httpx.post(f"{cluster.replicas[0].url}/v1/completions", json=body, headers=headers, timeout=30)
    routed = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert direct.status_code == routed.status_code == 404
    assert routed.json() == direct.json()
    bad = httpx.post(f"{cluster.url}/v1/chat/completions", json={"model": "tiny", "messages": []},
                     headers=headers, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    # A large body (hashed off the router's event loop) that the replica refuses as too long.
    long_body = {"model": "tiny", "prompt": "refund " * 6000, "max_tokens": 2}
    too_long = httpx.post(f"{cluster.url}/v1/completions", json=long_body, headers=headers, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_requests_go_to_the_replica_that_holds_the_tenants_prefix(cluster):
    holder = cluster.replicas[1]
    # Warm alice's prefix on replica 1 behind the router's back: only its published KV state can say so.
    direct = openai.OpenAI(base_url=f"{holder.url}/v1", api_key=ALICE, max_retries=0)
    direct.chat.completions.create(model="tiny", messages=[{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": "warm"}], max_tokens=2)
    wait_until(lambda: published(cluster, holder) > 0, 10, "replica 1's KV state in Redis")
    time.sleep(1.0)  # the router reads the store every 0.5 s
    hits_before = samples(metrics_base(holder, cluster), "sits_prefix_cache_hits_total", tenant="alice")
    for question in ("Where is my refund?", "Why was I charged twice?", "Do points expire?"):
        chat(cluster, question)
    assert samples(cluster.url, "sits_router_requests_total", replica=holder.url, policy_decision="prefix") == 3
    assert samples(metrics_base(holder, cluster), "sits_prefix_cache_hits_total", tenant="alice") - hits_before >= 3 * 64
    # Bob's identical system prompt is salted differently: nothing of his is on replica 1.
    chat(cluster, "Where is my refund?", key=BOB)
    assert samples(cluster.url, "sits_router_prefix_match_ratio_count", tenant="bob") == 1
    assert samples(cluster.url, "sits_router_prefix_match_ratio_bucket", tenant="bob", le="0.0") == 1
    assert all(samples(metrics_base(r, cluster), "sits_prefix_cache_cross_tenant_hits_total") == 0 for r in cluster.replicas)


def test_the_canary_tenant_goes_to_the_canary_track_only(cluster):
    canary, stable = cluster.replicas
    assert samples(cluster.url, "sits_router_replica_up", replica=canary.url, track="canary") == 1
    assert samples(cluster.url, "sits_router_replica_up", replica=stable.url, track="stable") == 1
    for question in ("Is shipping free?", "Can I change my address?"):
        chat(cluster, question, key=BOB)
        chat(cluster, question, key=ALICE)
    assert samples(metrics_base(stable, cluster), "sits_prefix_cache_queries_total", tenant="bob") == 0
    assert samples(metrics_base(canary, cluster), "sits_prefix_cache_queries_total", tenant="bob") > 0
    assert samples(metrics_base(canary, cluster), "sits_prefix_cache_queries_total", tenant="alice") == 0


def test_streams_pass_through(cluster):
    stream = cluster.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count to three"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    models = cluster.client().models.list()
    assert [m.id for m in models.data][0] == "tiny"


def test_redis_restarted_routes_by_load_then_rebuilds_the_index(cluster):
    assert cluster.redis is not None
    for replica in cluster.replicas:  # each replica holds a prefix, whichever tests ran before
        direct = openai.OpenAI(base_url=f"{replica.url}/v1", api_key=ALICE, max_retries=0)
        direct.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "system", "content": "Before the outage. " * 20}, {"role": "user", "content": "hi"}])
    wait_until(lambda: all(samples(cluster.url, "sits_router_kv_index_blocks", replica=r.url) > 0
                           for r in cluster.replicas), 10, "both replicas in the router's index")
    cluster.redis.kill()
    wait_until(lambda: samples(cluster.url, "sits_router_state_store_up") == 0, 10, "the router to see Redis gone")
    assert samples(cluster.url, "sits_router_kv_index_blocks") == 0
    load_before = samples(cluster.url, "sits_router_requests_total", policy_decision="load")
    for index in range(4):  # new prefixes, routed by load while the store is gone; none fails
        reply = cluster.client(BOB).chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": f"Outage prompt {index}. " * 20},
                                    {"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
    assert samples(cluster.url, "sits_router_requests_total", policy_decision="load") - load_before == 4
    with started(redis_argv(cluster.redis_port), cluster.redis_port, workdir=cluster.workdir,
                 log_name="redis2.log") as cluster.redis:
        # Replicas write their whole state back; the router's next read rebuilds its index.
        wait_until(lambda: all(samples(cluster.url, "sits_router_kv_index_blocks", replica=r.url) > 0
                               for r in cluster.replicas), 20, "the router's index rebuilt")
        assert samples(cluster.url, "sits_router_state_store_up") == 1
        run_with_a_replica_killed(cluster)
        no_key_in_logs_or_metrics(cluster)


def run_with_a_replica_killed(cluster: Cluster) -> None:
    """A replica killed mid-load: every request that had not started streaming succeeds (on the
    other replica), and the dead one leaves the pool within 5 s."""
    results: list[str | BaseException] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        for turn in range(4):
            try:
                reply = chat(cluster, f"User {index} turn {turn}: what about my order?", max_tokens=48,
                             key=ALICE if index % 2 else BOB)
            except BaseException as error:  # noqa: BLE001 - recorded for the assertion below
                reply = error
            with lock:
                results.append(reply)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    def busy() -> list[RunningService]:
        return [r for r in cluster.replicas if samples(cluster.url, "sits_router_replica_in_flight", replica=r.url)]

    victim = wait_until(busy, 60, "a request in flight")[0]
    killed_at = time.monotonic()
    victim.kill()
    wait_until(lambda: httpx.get(f"{cluster.url}/health").json()["replicas_up"] == 1, 5, "the dead replica out")
    assert time.monotonic() - killed_at < 5
    for thread in threads:
        thread.join(timeout=120)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert len(results) == 16 and not failures, failures
    assert samples(cluster.url, "sits_router_replica_up", replica=victim.url) == 0
    # The request in flight on the victim was answered by the other replica.
    assert samples(cluster.url, "sits_router_upstream_errors_total", replica=victim.url) >= 1
    assert samples(cluster.url, "sits_router_requests_total", policy_decision="failover") >= 1


def no_key_in_logs_or_metrics(cluster: Cluster) -> None:
    alive = [r for r in cluster.replicas if r.process.poll() is None]
    texts = [httpx.get(f"{cluster.url}/metrics").text] + [httpx.get(metrics_url(r, cluster)).text for r in alive]
    texts += [path.read_text(errors="replace") for path in cluster.workdir.glob("*.log")]
    assert any("router: replica" in text for text in texts)  # the router's log was read
    for text in texts:
        assert ALICE not in text and BOB not in text
