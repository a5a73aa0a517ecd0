"""Tenants: API keys from Secrets become digests in the ConfigMap and in the runtime's Redis tenant table.

Redis being down delays only the table: the rollout goes on, and the table is written once Redis
is back. The runtime's own state store reads what the operator wrote.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time

import yaml

from sits.runtime.tenancy.state_store import open_state_store
from sits.runtime.tenancy.tenants import parse_tenants
from tests.operator.helpers import sitsdeployment, wait_for, wait_for_status
from tests.support.services import free_port, redis_server

FINANCE_KEY = "sk-finance-7f3a9c"
BETA_KEY = "sk-beta-11d2e8"


def secret(name: str, key: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "llm"},
            "data": {"token": base64.b64encode(key.encode()).decode()}}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def read_table(url: str):
    store = open_state_store(url, deployment="llm.tenants")
    await store.start()
    try:
        return await store.get_tenant_table()
    finally:
        await store.close()


def test_tenant_table_reaches_redis_once_it_is_up_and_never_holds_keys(kube, deployments, run_operator):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    kube.create(secret("finance-key", FINANCE_KEY))
    tenants = [{"name": "finance", "priority": 3, "kvCacheShare": 0.4, "apiKeySecretRef": {"name": "finance-key", "key": "token"},
                "limits": {"requestsPerMinute": 600}},
               {"name": "beta", "priority": 1, "apiKeySecretRef": {"name": "beta-key", "key": "token"}}]
    with run_operator() as runner:
        kube.create(sitsdeployment("tenants", tenancy={"redis": {"url": url}, "tenants": tenants}))
        wait_for_status(kube, "tenants", lambda s: s.get("phase") == "Healthy", what="Healthy while Redis is down")
        status = wait_for_status(kube, "tenants", lambda s: (s.get("tenancy") or {}).get("reason") == "RedisUnavailable",
                                 what="the sync to report Redis down")
        assert status["tenancy"]["synced"] is False and "tenant beta: Secret beta-key not found" in status["tenancy"]["message"]
        with redis_server(port):
            status = wait_for_status(kube, "tenants", lambda s: s["tenancy"]["reason"] == "SecretsMissing",
                                     what="the table written without beta")
            kube.create(secret("beta-key", BETA_KEY))
            status = wait_for_status(kube, "tenants", lambda s: s["tenancy"]["synced"], what="synced")
            assert status["tenancy"]["tenants"] == 2 and status["tenancy"]["reason"] == "Synced"
            record = asyncio.run(read_table(url))
            table = parse_tenants(record.document)  # the runtime's own validation of what the operator wrote
            assert table.by_key(FINANCE_KEY).name == "finance" and table.by_key(BETA_KEY).name == "beta"
            assert table.get("finance").requests_per_minute == 600 and table.get("finance").priority == 3
            version = record.version
            wait_for(lambda: "beta" in (kube.get("v1", "ConfigMap", "llm", "tenants-engine") or {})
                     .get("data", {}).get("tenants.yaml", ""), what="beta in the ConfigMap")
            config_map = kube.get("v1", "ConfigMap", "llm", "tenants-engine")
            listed = yaml.safe_load(config_map["data"]["tenants.yaml"])["tenants"]
            assert {t["name"]: t["apiKeySha256"] for t in listed} == {"finance": digest(FINANCE_KEY),
                                                                        "beta": digest(BETA_KEY)}
            time.sleep(1.5)  # three more syncs: the same table is not written again
            assert asyncio.run(read_table(url)).version == version
            kube.delete("sits.ai/v1alpha1", "SitsDeployment", "llm", "tenants")
            wait_for(lambda: asyncio.run(read_table(url)) is None, what="the deleted resource's table gone")
    for text in (runner.output, yaml.safe_dump(config_map)):
        assert FINANCE_KEY not in text and BETA_KEY not in text
