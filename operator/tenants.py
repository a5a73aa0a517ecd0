"""Tenant records as the runtime reads them: the spec's tenants with their API keys replaced by SHA-256.

Each record writes its entry of the tenants document through the schema the runtime reads it with
(`sits.runtime.tenancy.tenants_schema`).

Keys are read from the referenced Secrets, hashed at once, and never kept, logged or written:
records, reprs and error messages only ever hold the digest or the Secret's name.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sits.operator.spec import TenancySpec
from sits.runtime.tenancy.tenants_schema import api_key_digest, tenant_entry

# Reads Secret `name` in the resource's namespace; returns its `data` (base64 values) or None if absent.
SecretReader = Callable[[str], dict[str, str] | None]


@dataclass(frozen=True)
class TenantRecord:
    """One entry of the runtime's tenants file / tenant table."""

    name: str
    api_key_sha256: str = field(repr=False)
    priority: int = 0
    kv_cache_share: float = 0.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    models: tuple[str, ...] | None = None  # the model ids the tenant may use; None: every served model
    host_kv_cache_share: float = 0.0  # guaranteed fraction of the host KV tier

    def to_document(self) -> dict[str, Any]:
        """This tenant's entry of the tenants document (`sits.runtime.tenancy.tenants_schema`)."""
        return tenant_entry(self.name, priority=self.priority, kv_cache_share=self.kv_cache_share,
                            host_kv_cache_share=self.host_kv_cache_share, api_key_sha256=self.api_key_sha256,
                            requests_per_minute=self.requests_per_minute, tokens_per_minute=self.tokens_per_minute,
                            models=self.models)


@dataclass(frozen=True)
class TenantResolution:
    """The records that could be built, and one line per tenant that could not (naming no key)."""

    records: list[TenantRecord]
    problems: list[str]

    def digest(self) -> str:
        """A short hash of the table, to tell whether what was last synced is still current."""
        document = json.dumps([r.to_document() for r in self.records], sort_keys=True)
        return hashlib.sha256(document.encode()).hexdigest()[:16]


def resolve_tenants(tenancy: TenancySpec, read_secret: SecretReader) -> TenantResolution:
    """Hash every tenant's API key from its Secret; a missing Secret or key is a problem, not an error."""
    records: list[TenantRecord] = []
    problems: list[str] = []
    secrets: dict[str, dict[str, str] | None] = {}
    for tenant in tenancy.tenants:
        ref = tenant.api_key_secret_ref
        if ref.name not in secrets:
            secrets[ref.name] = read_secret(ref.name)
        data = secrets[ref.name]
        if data is None:
            problems.append(f"tenant {tenant.name}: Secret {ref.name} not found")
            continue
        encoded = data.get(ref.key)
        if encoded is None:
            problems.append(f"tenant {tenant.name}: Secret {ref.name} has no key {ref.key!r}")
            continue
        try:
            api_key = base64.b64decode(encoded, validate=True).decode("utf-8").strip()
        except (binascii.Error, UnicodeDecodeError):
            problems.append(f"tenant {tenant.name}: Secret {ref.name} key {ref.key!r} is not base64 UTF-8 text")
            continue
        if not api_key:
            problems.append(f"tenant {tenant.name}: Secret {ref.name} key {ref.key!r} is empty")
            continue
        records.append(TenantRecord(
            name=tenant.name, api_key_sha256=api_key_digest(api_key).hex(),
            priority=tenant.priority, kv_cache_share=tenant.kv_cache_share,
            requests_per_minute=tenant.requests_per_minute, tokens_per_minute=tenant.tokens_per_minute,
            models=tenant.models, host_kv_cache_share=tenant.host_kv_cache_share))
        del api_key
    return TenantResolution(records=records, problems=problems)
