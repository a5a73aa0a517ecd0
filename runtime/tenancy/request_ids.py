"""Time-ordered request ids (UUIDv7, RFC 9562) and the time they carry.

A request id sorts by creation time and carries it (`request_id_unix_ms`): the KV cache reads it
once per block owner (`sits.runtime.engine.eviction.BlockOwner.issued_at`) as the time of a
block's last use, which the tenant eviction score counts from; logs sort by time. Ids made by one
`RequestIdGenerator` are strictly increasing even within one millisecond and when the wall clock
steps back (RFC 9562 section 6.2, method 2: the 74 random bits are incremented by a random step
inside a millisecond). The server's generator is the one that makes them
(`sits.runtime.server.request_ids`).

Layout (128 bits): unix_ts_ms (48) | version 7 (4) | rand_a (12) | variant 0b10 (2) | rand_b (62).
"""

from __future__ import annotations

import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable

_RANDOM_BITS = 74
_RANDOM_LIMIT = 1 << _RANDOM_BITS
_FRESH_BITS = _RANDOM_BITS - 1  # a fresh millisecond starts in the lower half: room to count up
_MAX_STEP_BITS = 32
_UUID7 = re.compile(r"([0-9a-f]{8})-?([0-9a-f]{4})-?(7[0-9a-f]{3})-?([89ab][0-9a-f]{3})-?([0-9a-f]{12})",
                    re.IGNORECASE)


class RequestIdGenerator:
    """Makes UUIDv7 strings; thread-safe and strictly increasing per generator.

    Args:
        clock_ns: wall clock in nanoseconds since the epoch (injectable for tests).
    """

    def __init__(self, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._clock_ns = clock_ns
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_random = 0

    def new_uuid(self) -> uuid.UUID:
        with self._lock:
            now_ms = self._clock_ns() // 1_000_000
            if now_ms > self._last_ms:
                self._last_ms, self._last_random = now_ms, secrets.randbits(_FRESH_BITS)
            else:  # same millisecond, or the clock stepped back: keep counting in the last one
                self._last_random += 1 + secrets.randbits(_MAX_STEP_BITS)
                if self._last_random >= _RANDOM_LIMIT:  # overflow: borrow the next millisecond
                    self._last_ms, self._last_random = self._last_ms + 1, secrets.randbits(_FRESH_BITS)
            return _pack(self._last_ms, self._last_random)

    def new(self) -> str:
        """A new request id in the canonical 8-4-4-4-12 form."""
        return str(self.new_uuid())


def _pack(unix_ms: int, random74: int) -> uuid.UUID:
    rand_a, rand_b = random74 >> 62, random74 & ((1 << 62) - 1)
    value = (unix_ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    return uuid.UUID(int=value)


def request_id_unix_ms(request_id: str) -> int:
    """Milliseconds since the epoch at which a UUIDv7 request id was made.

    The id may carry a prefix or suffix (`chatcmpl-<uuid>`, `<uuid>-1`); raises ValueError when it
    holds no UUIDv7.
    """
    match = _UUID7.search(request_id)
    if match is None:
        raise ValueError(f"not a time-ordered (UUIDv7) request id: {request_id!r}")
    return int("".join(match.groups())[:12], 16)

