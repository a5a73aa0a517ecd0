"""The tenants document: its fields, the rules of its values, and the one writer of its entries.

The document is what `sits serve --tenants` reads (a YAML file), what the state store holds for live
updates, and what the operator writes (the ConfigMap's `tenants.yaml`, the table in Redis) from a
SitsDeployment's `spec.tenancy`:

    {"sharedPrefixPool": false,
     "tenants": [{"name": "finance", "apiKeySha256": "9f86d0...", "priority": 3, "kvCacheShare": 0.4,
                  "hostKvCacheShare": 0.5, "weight": 1.0, "requestsPerMinute": 600,
                  "tokensPerMinute": 200000, "models": ["llama-3-8b-instruct"], "admin": false}]}

The runtime (`sits.runtime.tenancy.tenants`) and the operator (`sits.operator.tenants`, `sits.operator.spec`)
both build on this module, so the two sides cannot drift apart. It imports neither torch nor anything of
the engine: the operator's process never loads them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

MAX_PRIORITY = 3
SHARE_TOLERANCE = 1e-9  # shares are decimals in YAML; 0.1 + 0.2 + 0.7 must pass
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")  # safe as a metric label and a Redis key part
SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")

TENANT_FIELDS = frozenset({"name", "apiKey", "apiKeySha256", "priority", "kvCacheShare", "hostKvCacheShare",
                           "requestsPerMinute", "tokensPerMinute", "weight", "models", "admin"})
TABLE_FIELDS = frozenset({"tenants", "sharedPrefixPool"})
MODEL_ID_RULE = "a non-blank string without surrounding spaces"


def api_key_digest(api_key: str) -> bytes:
    """SHA-256 of an API key (32 bytes); the only form in which a key is kept (hex in the document)."""
    return hashlib.sha256(api_key.encode("utf-8")).digest()


class ModelIdsError(ValueError):
    """A `models` allow-list the schema refuses.

    Attributes:
        index: the entry at fault; None when the value is not a non-empty list.
        value: that entry (or the whole value when index is None).
        repeated: the entry repeats an earlier one (else it is not a model id).
    """

    def __init__(self, index: int | None, value: Any, repeated: bool = False) -> None:
        self.index, self.value, self.repeated = index, value, repeated
        what = "a non-empty list of model ids" if index is None else f"entry {index}"
        super().__init__(f"models: {what} is invalid, got {value!r}")


def model_ids(value: Any) -> tuple[str, ...] | None:
    """A tenant's `models` allow-list: None when absent (every served model), else a non-empty list of
    distinct model ids (`MODEL_ID_RULE`). Ids the server does not serve are allowed (the runtime warns):
    the list may name adapters before they are rolled out.

    Raises:
        ModelIdsError: the first problem found.
    """
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value:
        raise ModelIdsError(None, value)
    for index, model_id in enumerate(value):
        if not isinstance(model_id, str) or not model_id.strip() or model_id != model_id.strip():
            raise ModelIdsError(index, model_id)
        if model_id in value[:index]:
            raise ModelIdsError(index, model_id, repeated=True)
    return tuple(value)


def tenant_entry(name: str, *, priority: int, kv_cache_share: float, host_kv_cache_share: float = 0.0,
                 api_key_sha256: str | None = None, requests_per_minute: int | None = None,
                 tokens_per_minute: int | None = None, models: Sequence[str] | None = None,
                 weight: float | None = None, admin: bool = False) -> dict[str, Any]:
    """One tenant as the document holds it: key digests in hex (never a key); optional fields only
    when set (a zero host share, no limit, no allow-list, no weight, not admin: left out). The key
    order is the one the operator's ConfigMap has always had, so its text does not change."""
    entry: dict[str, Any] = {"name": name}
    if api_key_sha256 is not None:
        entry["apiKeySha256"] = api_key_sha256
    entry.update(priority=priority, kvCacheShare=kv_cache_share)
    optional = {"weight": weight, "requestsPerMinute": requests_per_minute, "tokensPerMinute": tokens_per_minute,
                "models": None if models is None else list(models), "hostKvCacheShare": host_kv_cache_share or None,
                "admin": True if admin else None}
    entry.update({key: value for key, value in optional.items() if value is not None})
    return entry


def tenants_document(entries: Sequence[dict[str, Any]], *,
                     shared_prefix_pool: bool | None = None) -> dict[str, Any]:
    """The whole document from `tenant_entry` entries; `sharedPrefixPool` only when given."""
    document: dict[str, Any] = {} if shared_prefix_pool is None else {"sharedPrefixPool": shared_prefix_pool}
    document["tenants"] = list(entries)
    return document
