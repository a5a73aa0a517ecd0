"""Tenant isolation under a mixed workload, and API keys that never leave the request they came in.

One real `sits serve` process (tiny random Llama) with three tenants (keys made fresh for this run),
the shared-prefix pool on, debug logging, and traces exported over OTLP/HTTP to a receiver here.
Three tenants send the same prompts concurrently, streamed and not, private and shared, alongside
wrong, truncated and malformed keys. Then:
- no tenant ever hit a block another tenant computed outside the shared pool: every response's
  cached tokens come from the tenant's own earlier requests, and /metrics counts 0 cross-tenant hits;
- no key, nor its secret part, appears in the server's log, /metrics, the exported traces, or any
  response body or header the server sent (401 bodies included).
The key comparison itself is `hmac.compare_digest` over SHA-256 digests, visiting every tenant on
every lookup whichever matched (checked below by counting the comparisons).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import http.server
import itertools
import secrets
import threading
from collections.abc import Iterator

import httpx
import pytest

from sits.runtime.tenancy import tenants as tenants_module
from sits.runtime.tenancy.tenants import parse_tenants
from tests.hardening.conftest import tiny_server
from tests.support.services import free_port

KEYS = {name: f"sk-{name}-{secrets.token_hex(16)}" for name in ("finance", "lab", "metered")}
# The last prompt is sent by finance and lab (twice each) before metered sends it once, privately.
PROMPTS = [(f"Quarterly report {i}. Revenue grew in every region; costs fell in logistics and rose in research. "
            "The board asks each team to summarise risks, hiring plans and budgets. ") * 2 for i in range(4)]
LAST = len(PROMPTS) - 1


def tenants_yaml() -> str:
    lines = ["sharedPrefixPool: true", "tenants:"]
    lines.append(f"  - {{name: finance, apiKey: \"{KEYS['finance']}\", priority: 3, kvCacheShare: 0.3}}")
    lines.append(f"  - {{name: lab, apiKey: \"{KEYS['lab']}\", priority: 1, kvCacheShare: 0.3}}")
    digest = hashlib.sha256(KEYS["metered"].encode()).hexdigest()
    lines.append(f"  - {{name: metered, apiKeySha256: \"{digest}\", kvCacheShare: 0.2}}")
    return "\n".join(lines) + "\n"


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: keeps every exported body."""

    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        self.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def send(url: str, tenant: str, prompt_index: int, stream: bool, shared: bool) -> dict:
    """One completion as `tenant`; returns what the test needs to judge it, with everything the server sent."""
    body = {"prompt": PROMPTS[prompt_index], "max_tokens": 2, "temperature": 0, "stream": stream,
            "shared_prefix": shared, **({"stream_options": {"include_usage": True}} if stream else {})}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    if stream:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        usage = httpx.Response(200, content=events[-2]).json()["usage"]
    else:
        usage = response.json()["usage"]
    return {"tenant": tenant, "prompt": prompt_index, "shared": shared,
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "sent": response.text + str(response.headers)}


def hostile_auth(url: str) -> list[str]:
    """Wrong, truncated, extended and malformed keys; returns everything the server answered."""
    key = KEYS["finance"]
    attempts = [f"Bearer {key[:-1]}", f"Bearer {key}x", f"bearer  {KEYS['lab'].upper()}", f"Basic {key}", key,
                f"Bearer {key} {KEYS['lab']}", f"Bearer {KEYS['metered'][:20]}"]
    answers = []
    for authorization in attempts:
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            response = httpx.request(method, f"{url}{path}", headers={"Authorization": authorization},
                                     json={"prompt": "hi", "max_tokens": 1}, timeout=30)
            assert response.status_code == 401, (authorization, response.text)
            answers.append(response.text + str(response.headers))
    return answers


def secret_parts(key: str) -> list[str]:
    return [key, key.rsplit("-", 1)[1]]  # the whole key, and its random part alone


def test_a_mixed_workload_never_crosses_tenants_and_no_key_leaks(tiny_llama_dir, tmp_path, otlp_receiver):
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(tenants_yaml())
    _Collector.bodies.clear()
    metrics_port = free_port()  # with tenants, /metrics is served on its own port only
    extra = ("--tenants", str(tenants_file), "--otlp-endpoint", otlp_receiver, "--max-num-seqs", "8",
             "--num-blocks", "96", "--log-level", "debug", "--metrics-port", str(metrics_port))
    with tiny_server(tiny_llama_dir, *extra) as server:
        # Every tenant, every prompt, streamed or not, private or shared: in a shuffled order, 6 at a time.
        plan = [(t, p, stream, shared) for t, p, stream, shared in itertools.product(
            KEYS, range(LAST), (False, True), (False, False, True))]
        secrets.SystemRandom().shuffle(plan)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda job: send(server.url, *job), plan))
            answers = hostile_auth(server.url)
        known = [send(server.url, tenant, LAST, stream=False, shared=False) for tenant in ("finance", "lab") * 2]
        lonely = send(server.url, "metered", LAST, stream=False, shared=False)
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        log_before_exit = (server.workdir / "serve.log").read_text()
        server.stop()  # SIGTERM: drain, and the tracer exports what it still holds
        log = (server.workdir / "serve.log").read_text()
    assert log.startswith(log_before_exit[:100])

    # Isolation: a private prompt's cached tokens can only be the tenant's own; shared ones need the pool.
    assert [r["cached"] > 0 for r in known] == [False, False, True, True]  # each tenant hits its own copy only
    assert lonely["cached"] == 0, "metered's first private request hit blocks other tenants computed"
    results += [*known, lonely]
    private_hits = [r for r in results if not r["shared"] and r["cached"] > 0]
    assert private_hits, "the workload repeated prompts per tenant: some private requests must hit their own cache"
    cross = [line for line in metrics.splitlines()
             if line.startswith("sits_prefix_cache_cross_tenant_hits_total{") and not line.endswith(" 0.0")]
    assert cross == [], cross
    hits = {line.split('tenant="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("sits_prefix_cache_hits_total{")}
    assert all(hits.get(tenant, 0) > 0 for tenant in KEYS), hits
    assert "sits_prefix_cache_shared_hits_total" in metrics

    # Secrets: grep every place a key could leak to.
    traces = b"".join(_Collector.bodies)
    assert b"sits.request" in traces, "the traces were exported"
    places = {"server log": log, "/metrics": metrics, "responses": "".join(r["sent"] for r in results),
              "401 answers": "".join(answers)}
    for key in KEYS.values():
        for part in secret_parts(key):
            for place, text in places.items():
                assert part not in text, f"a key leaked into the {place}"
            assert part.encode() not in traces, "a key leaked into the traces"
    assert "Traceback" not in log


def test_key_lookup_compares_every_digest_in_constant_time(monkeypatch):
    table = parse_tenants({"tenants": [{"name": n, "apiKey": k} for n, k in KEYS.items()]})
    compared: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(tenants_module.hmac, "compare_digest", counting)
    for presented in (KEYS["finance"], KEYS["metered"], "sk-nobody", "x" * 10_000):
        compared.clear()
        table.by_key(presented)
        # every tenant's digest, whichever matched (no early exit), always 32-byte digests (no length leak)
        assert len(compared) == len(KEYS)
        assert all(len(a) == len(b) == 32 for a, b in compared)
    assert table.by_key(KEYS["lab"]).name == "lab" and table.by_key(KEYS["lab"] + " ") is None
