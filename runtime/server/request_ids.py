"""Time-ordered request ids (UUIDv7, RFC 9562).

The first 48 bits of a UUIDv7 are the Unix time in milliseconds, so ids sort by arrival and the
KV-cache eviction score can read a request's age back from its id (`uuid7_time`).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid

_HEX32 = re.compile(r"[0-9a-f]{32}")
_lock = threading.Lock()
_last_ms = 0
_counter = 0  # 12-bit sequence within one millisecond keeps ids monotonic (RFC 9562, method 1)


def uuid7() -> uuid.UUID:
    """A new UUIDv7: 48-bit ms timestamp, version 7, 12-bit monotonic counter, variant, 62 random bits."""
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms <= _last_ms:
            _counter += 1
            if _counter > 0xFFF:  # counter overflow: borrow the next millisecond
                _last_ms += 1
                _counter = 0
            now_ms = _last_ms
        else:
            _last_ms = now_ms
            _counter = int.from_bytes(os.urandom(2), "big") & 0x3FF  # random start, room to count up
        counter = _counter
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (now_ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76
    value |= counter << 64
    value |= 0b10 << 62
    value |= rand_b
    return uuid.UUID(int=value)


def uuid7_time(value: uuid.UUID | str) -> float:
    """The creation time (Unix seconds) encoded in a UUIDv7 or in an id that ends with one."""
    if isinstance(value, str):
        match = _HEX32.search(value)
        if match is None:
            raise ValueError(f"no UUIDv7 in request id {value!r}")
        value = uuid.UUID(match.group(0))
    return (value.int >> 80) / 1000.0


def new_request_id(prefix: str) -> str:
    """`<prefix>-<uuid7 hex>`, e.g. `chatcmpl-0190f1c2...`: the OpenAI response id of one request."""
    return f"{prefix}-{uuid7().hex}"
