"""Which adapters requests are using, so an adapter is unloaded only when none is (runtime updates).

`AsyncEngine.generate` enters a request's adapter before queueing it and leaves it when its stream
ends; `close` refuses new requests for an adapter about to be unloaded, and only succeeds while
nothing is in flight on it, so its slot is never zeroed under a running sequence.
"""

from __future__ import annotations

import threading

from sits.runtime.engine.errors import InvalidRequestError


class AdapterUsage:
    """Requests in flight per adapter name, and the names closed to new requests (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._closed: set[str] = set()

    def enter(self, name: str | None) -> None:
        """One more request on `name` (None: the base model, not counted).

        Raises:
            InvalidRequestError: the adapter is being unloaded.
        """
        if name is None:
            return
        with self._lock:
            if name in self._closed:
                raise InvalidRequestError(f"the LoRA adapter {name!r} is being unloaded")
            self._in_flight[name] = self._in_flight.get(name, 0) + 1

    def leave(self, name: str | None) -> None:
        if name is None:
            return
        with self._lock:
            left = self._in_flight.pop(name, 1) - 1
            if left > 0:
                self._in_flight[name] = left

    def in_flight(self, name: str) -> int:
        with self._lock:
            return self._in_flight.get(name, 0)

    def close(self, name: str) -> int:
        """Close `name` to new requests if none is in flight; return how many are (0: closed)."""
        with self._lock:
            busy = self._in_flight.get(name, 0)
            if not busy:
                self._closed.add(name)
            return busy

    def reopen(self, name: str) -> None:
        """Undo `close` (after the unload, or when it failed)."""
        with self._lock:
            self._closed.discard(name)
