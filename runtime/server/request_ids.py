"""The OpenAI response ids of the server: `<prefix>-<UUIDv7 hex>`, time-ordered.

The ids come from the one UUIDv7 generator of the project (`sits.runtime.tenancy.request_ids`):
they sort by arrival, and the KV-cache eviction score reads a request's age back from its id.
"""

from __future__ import annotations

import uuid

from sits.runtime.tenancy.request_ids import RequestIdGenerator, request_id_unix_ms

_generator = RequestIdGenerator()


def uuid7() -> uuid.UUID:
    """A new UUIDv7 (RFC 9562), strictly increasing within this process."""
    return _generator.new_uuid()


def uuid7_time(value: uuid.UUID | str) -> float:
    """The creation time (Unix seconds) carried by a UUIDv7, or by an id that contains one."""
    return request_id_unix_ms(str(value)) / 1000.0


def new_request_id(prefix: str) -> str:
    """`<prefix>-<uuid7 hex>`, e.g. `chatcmpl-0190f1c2...`: the OpenAI response id of one request."""
    return f"{prefix}-{uuid7().hex}"
