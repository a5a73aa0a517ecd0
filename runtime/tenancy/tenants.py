"""Tenants: who may call the server, with which priority, KV-cache share and rate limits.

A tenants file (`sits serve --tenants tenants.yaml`) looks like:

    sharedPrefixPool: false          # optional: prompts marked shared hit one pool across tenants
    tenants:
      - {name: finance, apiKey: "sk-...", priority: 3, kvCacheShare: 0.4, hostKvCacheShare: 0.5,
         requestsPerMinute: 600, tokensPerMinute: 200000}
      - {name: research, apiKeySha256: "9f86d0...", priority: 1, kvCacheShare: 0.2,
         models: [llama-3-8b-instruct, research-sql]}   # optional allow-list, see below

API keys are hashed with SHA-256 as soon as they are read; only the digest is kept, and it is
shown by no repr, log line or error message. The same table, with digests only, is what the
state store holds so an operator can update tenants live (`TenantTable.to_document`).

`models` lists the model ids a tenant may use: the base model's served name and LoRA adapter
names. Absent, the tenant may use every model the server serves; an empty list is an error (a
tenant that may use nothing should be removed). To the tenant, a model outside its list does not
exist: requests for it are the same 404 as for an unknown model and /v1/models leaves it out. An
id the server does not serve is not an error here (the table may be written before adapters
change); the server logs a warning for it (`TenantTable.unserved_models`).

`admin: true` marks a tenant whose key may load and unload LoRA adapters at runtime (with
`--allow-runtime-lora-updating`); absent, it is false.

The document's fields, the rules of its values and its writer are `tenants_schema`'s, which the
operator writes the same document with.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sits.runtime.tenancy.tenants_schema import (
    MAX_PRIORITY,
    MODEL_ID_RULE,
    SHA256_HEX,
    SHARE_TOLERANCE,
    TABLE_FIELDS,
    TENANT_FIELDS,
    TENANT_NAME,
    ModelIdsError,
    api_key_digest,
    model_ids,
    tenant_entry,
    tenants_document,
)

__all__ = ["DEFAULT_TENANT", "MAX_PRIORITY", "SHARED_PREFIX_SALT", "Tenant", "TenantConfigError", "TenantTable",
           "api_key_digest", "load_tenants_file", "parse_tenants"]

DEFAULT_TENANT = "default"
_SALT_DOMAIN = b"sits/prefix-salt/v1\x00"
SHARED_PREFIX_SALT = hashlib.sha256(_SALT_DOMAIN + b"\x00shared-prefix-pool").hexdigest()[:32]


class TenantConfigError(ValueError):
    """The tenants file is invalid; the message names the file, the tenant and the field."""


@dataclass(frozen=True)
class Tenant:
    """One tenant.

    Attributes:
        name: the `tenant` metric label and the key part in the state store.
        priority: 0 (lowest) to 3; higher tiers are scheduled first and their cached blocks
            score higher (are evicted later).
        kv_cache_share: guaranteed fraction of the KV-cache blocks, 0 to 1.
        host_kv_cache_share: guaranteed fraction of the host KV tier's blocks (--host-kv-cache-gb),
            0 to 1; beyond it a tenant borrows blocks nobody is guaranteed, as on the GPU.
        requests_per_minute, tokens_per_minute: limits across all replicas; None is unlimited.
        weight: share of scheduling inside the priority tier, relative to the tier's other tenants.
        api_key_sha256: digest of the API key (None in trusted-gateway mode); never shown.
        models: the model ids (served base-model name, LoRA adapter names) this tenant may use;
            None allows every model the server serves.
        admin: may call the operator endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`).
    """

    name: str
    priority: int = 0
    kv_cache_share: float = 0.0
    host_kv_cache_share: float = 0.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    weight: float = 1.0
    api_key_sha256: bytes | None = field(default=None, repr=False, compare=False)
    models: tuple[str, ...] | None = None
    admin: bool = False

    def may_use(self, model_id: str) -> bool:
        """Whether this tenant's allow-list admits `model_id` (every id when it has no list)."""
        return self.models is None or model_id in self.models

    @property
    def prefix_salt(self) -> str:
        """Goes into the prefix-cache hash chain of this tenant's prompts (`Sequence.cache_salt`),
        so tenants never share a hit. Derived from the name: stable across replicas and restarts."""
        return hashlib.sha256(_SALT_DOMAIN + self.name.encode("utf-8")).hexdigest()[:32]

    @property
    def has_rate_limits(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


class TenantTable:
    """The validated tenants, looked up by API key (constant time) or by name."""

    def __init__(self, tenants: Iterable[Tenant], *, shared_prefix_pool: bool = False,
                 requires_auth: bool = True) -> None:
        self._tenants: dict[str, Tenant] = {}
        for tenant in tenants:
            if tenant.name in self._tenants:
                raise TenantConfigError(f'tenant "{tenant.name}" appears twice')
            self._tenants[tenant.name] = tenant
        self.shared_prefix_pool = shared_prefix_pool
        self.requires_auth = requires_auth
        self._digests = [(t.api_key_sha256, t) for t in self._tenants.values() if t.api_key_sha256 is not None]

    @classmethod
    def open_access(cls) -> TenantTable:
        """The table of a server started without --tenants: one tenant, no key, the whole cache."""
        return cls([Tenant(DEFAULT_TENANT, kv_cache_share=1.0, host_kv_cache_share=1.0)], requires_auth=False)

    def __repr__(self) -> str:
        return f"TenantTable({sorted(self._tenants)}, shared_prefix_pool={self.shared_prefix_pool})"

    def __len__(self) -> int:
        return len(self._tenants)

    def __iter__(self):
        return iter(self._tenants.values())

    def __contains__(self, name: object) -> bool:
        return name in self._tenants

    @property
    def names(self) -> list[str]:
        return list(self._tenants)

    def shares(self) -> dict[str, float]:
        """kvCacheShare by tenant (for ShardAccountant)."""
        return {t.name: t.kv_cache_share for t in self._tenants.values()}

    def host_shares(self) -> dict[str, float]:
        """hostKvCacheShare by tenant (for the host tier's ShardAccountant)."""
        return {t.name: t.host_kv_cache_share for t in self._tenants.values()}

    def priorities(self) -> dict[str, int]:
        """priority by tenant (for the eviction score and preemption)."""
        return {t.name: t.priority for t in self._tenants.values()}

    def weights(self) -> dict[str, float]:
        """scheduling weight by tenant (for FairQueue)."""
        return {t.name: t.weight for t in self._tenants.values()}

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def unserved_models(self, served: Collection[str]) -> dict[str, list[str]]:
        """Tenant name -> the ids in its `models` that are not among `served` (tenants with none left out)."""
        unserved = {t.name: [m for m in t.models if m not in served] for t in self._tenants.values() if t.models}
        return {name: ids for name, ids in unserved.items() if ids}

    def by_key(self, api_key: str) -> Tenant | None:
        """The tenant whose key this is, or None.

        Every stored digest is compared with `hmac.compare_digest` and the loop never stops early,
        so the time taken says nothing about which tenant (if any) matched or how closely.
        """
        presented = api_key_digest(api_key)
        found: Tenant | None = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found

    def prefix_salt(self, tenant: Tenant, shared: bool = False) -> str:
        """The salt for this request's prefix hashes: the shared pool's only for prompts marked
        shared, and only when the table enables the pool."""
        return SHARED_PREFIX_SALT if shared and self.shared_prefix_pool else tenant.prefix_salt

    def to_document(self) -> dict[str, Any]:
        """The table as plain data for the state store (`tenants_schema`): key digests in hex, never a key."""
        entries = [tenant_entry(t.name, priority=t.priority, kv_cache_share=t.kv_cache_share,
                                host_kv_cache_share=t.host_kv_cache_share,
                                api_key_sha256=None if t.api_key_sha256 is None else t.api_key_sha256.hex(),
                                requests_per_minute=t.requests_per_minute, tokens_per_minute=t.tokens_per_minute,
                                models=t.models, weight=t.weight, admin=t.admin)
                   for t in self._tenants.values()]
        return tenants_document(entries, shared_prefix_pool=self.shared_prefix_pool)


def load_tenants_file(path: str | Path, *, require_keys: bool = True) -> TenantTable:
    """Read and validate a tenants YAML file; raises TenantConfigError naming the problem."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise TenantConfigError(f"cannot read tenants file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise TenantConfigError(f"{path}: not valid YAML{where}") from None
    return parse_tenants(data, source=str(path), require_keys=require_keys)


def parse_tenants(data: Any, *, source: str = "tenants", require_keys: bool = True) -> TenantTable:
    """Validate the parsed YAML (or a state-store document) into a TenantTable.

    Args:
        data: {"tenants": [...], "sharedPrefixPool": bool}.
        source: how error messages name the input (the file path).
        require_keys: every tenant needs exactly one of apiKey / apiKeySha256 (False in
            trusted-gateway mode, where keys are optional).
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("tenants"), list):
        raise TenantConfigError(f"{source}: expected a mapping with a `tenants:` list")
    unknown = set(data) - TABLE_FIELDS
    if unknown:
        raise TenantConfigError(f"{source}: unknown top-level field(s) {', '.join(sorted(map(str, unknown)))}")
    shared = data.get("sharedPrefixPool", False)
    if not isinstance(shared, bool):
        raise TenantConfigError(f"{source}: sharedPrefixPool must be true or false")
    tenants = [_parse_tenant(entry, index, source, require_keys) for index, entry in enumerate(data["tenants"])]
    if not tenants:
        raise TenantConfigError(f"{source}: `tenants:` is empty; leave out --tenants to serve without keys")
    _check_unique(tenants, source)
    total_share = sum(t.kv_cache_share for t in tenants)
    if total_share > 1.0 + SHARE_TOLERANCE:
        listed = ", ".join(f"{t.name}={t.kv_cache_share:g}" for t in tenants if t.kv_cache_share)
        raise TenantConfigError(f"{source}: kvCacheShare values sum to {total_share:g} (> 1): {listed}")
    host_total = sum(t.host_kv_cache_share for t in tenants)
    if host_total > 1.0 + SHARE_TOLERANCE:
        listed = ", ".join(f"{t.name}={t.host_kv_cache_share:g}" for t in tenants if t.host_kv_cache_share)
        raise TenantConfigError(f"{source}: hostKvCacheShare values sum to {host_total:g} (> 1): {listed}")
    return TenantTable(tenants, shared_prefix_pool=shared)


def _parse_tenant(entry: Any, index: int, source: str, require_keys: bool) -> Tenant:
    if not isinstance(entry, Mapping):
        raise TenantConfigError(f"{source}: tenants[{index}] must be a mapping")
    name = entry.get("name")
    if not isinstance(name, str) or not TENANT_NAME.match(name):
        raise TenantConfigError(
            f"{source}: tenants[{index}].name must be 1-63 letters, digits, '.', '_' or '-', got {name!r}")
    where = f'{source}: tenant "{name}"'
    unknown = set(entry) - TENANT_FIELDS
    if unknown:
        raise TenantConfigError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    return Tenant(
        name=name,
        priority=_integer(entry, "priority", where, default=0, low=0, high=MAX_PRIORITY),
        kv_cache_share=_number(entry, "kvCacheShare", where, default=0.0, low=0.0, high=1.0),
        host_kv_cache_share=_number(entry, "hostKvCacheShare", where, default=0.0, low=0.0, high=1.0),
        requests_per_minute=_integer(entry, "requestsPerMinute", where, default=None, low=1),
        tokens_per_minute=_integer(entry, "tokensPerMinute", where, default=None, low=1),
        weight=_number(entry, "weight", where, default=1.0, low=1e-6, high=1e6),
        api_key_sha256=_key_digest(entry, where, require_keys),
        models=_model_ids(entry, where),
        admin=_admin(entry, where),
    )


def _admin(entry: Mapping, where: str) -> bool:
    """`admin: true` lets the tenant's key load and unload LoRA adapters; absent means false."""
    value = entry.get("admin", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TenantConfigError(f"{where}: admin must be true or false, got {value!r}")
    return value


def _model_ids(entry: Mapping, where: str) -> tuple[str, ...] | None:
    """The tenant's `models` allow-list (`tenants_schema.model_ids`), its problems worded for the file."""
    try:
        return model_ids(entry.get("models"))
    except ModelIdsError as error:
        if error.index is None:
            raise TenantConfigError(f"{where}: models must be a non-empty list of model ids (leave it out to "
                                    f"allow every served model), got {error.value!r}") from None
        if error.repeated:
            raise TenantConfigError(f"{where}: models lists {error.value!r} twice") from None
        raise TenantConfigError(f"{where}: models[{error.index}] must be a model id ({MODEL_ID_RULE}), "
                                f"got {error.value!r}") from None


def _key_digest(entry: Mapping, where: str, require_keys: bool) -> bytes | None:
    has_key, has_digest = "apiKey" in entry, "apiKeySha256" in entry
    if has_key and has_digest:
        raise TenantConfigError(f"{where}: give apiKey or apiKeySha256, not both")
    if not has_key and not has_digest:
        if require_keys:
            raise TenantConfigError(f"{where}: apiKey or apiKeySha256 is required")
        return None
    if has_key:
        key = entry["apiKey"]
        if not isinstance(key, str) or not key.strip():
            raise TenantConfigError(f"{where}: apiKey must be a non-empty string")
        return api_key_digest(key)
    digest = entry["apiKeySha256"]
    if not isinstance(digest, str) or not SHA256_HEX.match(digest):
        raise TenantConfigError(f"{where}: apiKeySha256 must be 64 hex digits (the SHA-256 of the key)")
    return bytes.fromhex(digest)


def _integer(entry: Mapping, key: str, where: str, *, default: int | None, low: int,
             high: int | None = None) -> int | None:
    if key not in entry or entry[key] is None:
        return default
    value = entry[key]
    span = f"between {low} and {high}" if high is not None else f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise TenantConfigError(f"{where}: {key} must be {span}, got {value!r}")
    return value


def _number(entry: Mapping, key: str, where: str, *, default: float, low: float, high: float) -> float:
    if key not in entry or entry[key] is None:
        return default
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise TenantConfigError(f"{where}: {key} must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _check_unique(tenants: list[Tenant], source: str) -> None:
    seen_names: set[str] = set()
    seen_keys: dict[bytes, str] = {}
    for tenant in tenants:
        if tenant.name in seen_names:
            raise TenantConfigError(f'{source}: tenant "{tenant.name}" appears twice')
        seen_names.add(tenant.name)
        if tenant.api_key_sha256 is None:
            continue
        other = seen_keys.get(tenant.api_key_sha256)
        if other is not None:
            raise TenantConfigError(f'{source}: tenants "{other}" and "{tenant.name}" have the same API key')
        seen_keys[tenant.api_key_sha256] = tenant.name
