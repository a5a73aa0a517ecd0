"""Sliding-window rate-limit arithmetic, shared by every state store.

Counts live in fixed windows (60 s, numbered `floor(unix_time / 60)`); the rate over the last
minute is estimated from the current and the previous window (the sliding-window counter):

    estimate = previous x (1 - f) + current,   f = fraction of the current window elapsed

A request is admitted when `estimate + 1 <= requestsPerMinute` and
`estimate_tokens + tokens <= tokensPerMinute`. The error against an exact sliding log is small
and errs on neither side systematically; memory is two counters per tenant and replica.

Windows are numbered from each replica's wall clock, so replicas sharing limits need synchronized
clocks (NTP: a skew of a second shifts a 60 s window by under 2 %).

`WindowBook` keeps this replica's own counts (authoritative: only this replica writes them) and
the other replicas' counts last seen in the shared store, so a replica can still decide when the
store is unreachable.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True)
class Limits:
    """Per-window limits of one tenant; None is unlimited."""

    requests: int | None = None
    tokens: int | None = None


@dataclass(frozen=True)
class WindowCounts:
    """Requests and tokens counted by all replicas in the current and the previous window."""

    requests: int = 0
    tokens: int = 0
    previous_requests: int = 0
    previous_tokens: int = 0


def window_index(now: float, window_s: float = WINDOW_S) -> int:
    return math.floor(now / window_s)


def elapsed_fraction(now: float, window_s: float = WINDOW_S) -> float:
    return (now % window_s) / window_s


def window_position(now: float, window_s: float = WINDOW_S) -> tuple[int, float]:
    """(index of the window holding `now`, fraction of that window elapsed)."""
    return window_index(now, window_s), elapsed_fraction(now, window_s)


def estimated_usage(counts: WindowCounts, fraction: float) -> tuple[float, float]:
    """(requests, tokens) over the sliding window ending now."""
    keep = 1.0 - fraction
    return counts.previous_requests * keep + counts.requests, counts.previous_tokens * keep + counts.tokens


def admits(counts: WindowCounts, fraction: float, limits: Limits, tokens: int) -> bool:
    requests_used, tokens_used = estimated_usage(counts, fraction)
    if limits.requests is not None and requests_used + 1 > limits.requests:
        return False
    return limits.tokens is None or tokens_used + tokens <= limits.tokens


def retry_after(counts: WindowCounts, fraction: float, limits: Limits, tokens: int,
                window_s: float = WINDOW_S) -> float | None:
    """Seconds until a request needing `tokens` would be admitted if nothing else arrived;
    None if it never fits (more tokens than the limit)."""
    if limits.tokens is not None and tokens > limits.tokens:
        return None
    wait = 0.0
    if limits.requests is not None:
        wait = max(wait, _wait(counts.requests, counts.previous_requests, fraction, limits.requests - 1, window_s))
    if limits.tokens is not None:
        wait = max(wait, _wait(counts.tokens, counts.previous_tokens, fraction, limits.tokens - tokens, window_s))
    return wait


def _wait(current: float, previous: float, fraction: float, room: float, window_s: float) -> float:
    """Smallest dt >= 0 with estimate(now + dt) <= room, assuming no new arrivals."""
    left_in_window = (1.0 - fraction) * window_s
    if previous * (1.0 - fraction) + current <= room:
        return 0.0
    # Still in this window: the previous window's weight decays linearly to 0 at its end.
    if current <= room and previous > 0:
        return max(0.0, left_in_window - (room - current) / previous * window_s)
    # In the next window `current` becomes the decaying previous and nothing is current.
    if current > 0 and room >= 0:
        return left_in_window + max(0.0, 1.0 - room / current) * window_s
    return left_in_window + window_s


class WindowBook:
    """This replica's counts per (tenant, window) plus the other replicas' last known counts."""

    def __init__(self) -> None:
        self.mine: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])  # [requests, tokens]
        self.others: dict[tuple[str, int], tuple[int, int]] = {}
        self.dirty: set[tuple[str, int]] = set()

    def add(self, tenant: str, index: int, requests: int, tokens: int) -> None:
        mine = self.mine[(tenant, index)]
        mine[0] += requests
        mine[1] += tokens
        self.dirty.add((tenant, index))
        self.prune(index)

    def admit_local(self, tenant: str, index: int, fraction: float, limits: Limits, tokens: int) -> tuple[bool, WindowCounts]:
        """Decide from these counts alone and count the request when it fits (a store with nothing
        shared, or one whose shared store is unreachable). Returns (allowed, the counts after)."""
        allowed = admits(self.counts(tenant, index), fraction, limits, tokens)
        if allowed:
            self.add(tenant, index, 1, tokens)
        return allowed, self.counts(tenant, index)

    def set_others(self, tenant: str, index: int, requests: int, tokens: int) -> None:
        self.others[(tenant, index)] = (requests, tokens)

    def counts(self, tenant: str, index: int) -> WindowCounts:
        now_r, now_t = self._total(tenant, index)
        prev_r, prev_t = self._total(tenant, index - 1)
        return WindowCounts(now_r, now_t, prev_r, prev_t)

    def _total(self, tenant: str, index: int) -> tuple[int, int]:
        mine = self.mine.get((tenant, index), (0, 0))
        others = self.others.get((tenant, index), (0, 0))
        return mine[0] + others[0], mine[1] + others[1]

    def recent(self, index: int) -> list[tuple[str, int, int, int]]:
        """(tenant, window, requests, tokens) of this replica for the current and previous window."""
        return [(t, i, c[0], c[1]) for (t, i), c in self.mine.items() if i >= index - 1]

    def prune(self, index: int) -> None:
        """Forget windows older than the previous one: they no longer count anywhere."""
        if len(self.mine) + len(self.others) < 64:
            return
        for book in (self.mine, self.others):
            for key in [k for k in book if k[1] < index - 1]:
                del book[key]
        self.dirty = {k for k in self.dirty if k[1] >= index - 1}
