"""Writing a SitsDeployment's tenant table into the Redis the runtime replicas share.

The layout is the runtime's (sits.runtime.tenancy.redis_store): the hash `sits:{deployment}:tenants`
holds {version, document}, where `document` is the tenants file's JSON with API-key digests only
and `version` grows by one on every write, which is how replicas notice live edits. The operator
names the deployment `{namespace}.{name}` and writes through the runtime's own PUT_TENANTS script,
and only when the document changed, so replicas reload only on real edits.

Redis being down is not an error here: the sync reports it and is retried on the next tick; the
rollout never waits for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sits.operator.meta import deployment_id
from sits.operator.tenants import TenantRecord
from sits.runtime.tenancy.redis_scripts import PUT_TENANTS
from sits.runtime.tenancy.state_store import redact_url
from sits.runtime.tenancy.tenants_schema import tenants_document


def table_key(namespace: str, name: str) -> str:
    return f"sits:{deployment_id(namespace, name)}:tenants"


def tenant_document(records: list[TenantRecord]) -> dict[str, Any]:
    return tenants_document([record.to_document() for record in records], shared_prefix_pool=False)


@dataclass(frozen=True)
class SyncResult:
    synced: bool
    reason: str  # Synced | RedisUnavailable | RedisError
    message: str


def sync_tenant_table(redis_url: str, namespace: str, name: str, records: list[TenantRecord],
                      timeout_s: float = 2.0) -> SyncResult:
    """Store the table unless Redis already holds the same document; never raises for Redis errors."""
    key = table_key(namespace, name)
    where = redact_url(redis_url)
    document = tenant_document(records)
    payload = json.dumps(document, sort_keys=True)
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      decode_responses=True)
    except ValueError as error:
        return SyncResult(False, "RedisError", f"invalid Redis URL {where}: {error}")
    try:
        stored = client.hget(key, "document")
        if stored is not None and json.loads(stored) == document:
            return SyncResult(True, "Synced", f"{len(records)} tenants in {key} at {where} (unchanged)")
        version = client.eval(PUT_TENANTS, 1, key, payload, "put", 0)
        return SyncResult(True, "Synced", f"{len(records)} tenants in {key} at {where} (version {version})")
    except (RedisConnectionError, RedisTimeoutError, OSError) as error:
        return SyncResult(False, "RedisUnavailable", f"Redis at {where} is unreachable ({type(error).__name__}); "
                                                     "the tenant table will be written when it is back")
    except (RedisError, ValueError) as error:
        return SyncResult(False, "RedisError", f"Redis at {where} refused the tenant table: {error}")
    finally:
        client.close()


def delete_tenant_table(redis_url: str, namespace: str, name: str, timeout_s: float = 2.0) -> bool:
    """Remove the table of a deleted SitsDeployment (best effort)."""
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.delete(table_key(namespace, name)))
        finally:
            client.close()
    except (RedisError, OSError, ValueError):
        return False
