"""RPM / TPM limits on the in-memory store: admission, sliding windows, Retry-After, 429 bodies."""

from __future__ import annotations

import pytest

from sits.runtime.tenancy.limits import RateLimiter
from sits.runtime.tenancy.memory_store import MemoryStateStore
from sits.runtime.tenancy.rate_windows import Limits, WindowCounts, retry_after
from sits.runtime.tenancy.tenants import Tenant

MINUTE_START = 1_700_000_040.0  # a multiple of 60: the start of a window


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_requests_per_minute_are_enforced_with_retry_after():
    clock = Clock(MINUTE_START + 30)
    limiter = RateLimiter(MemoryStateStore(), clock)
    tenant = Tenant("finance", requests_per_minute=5)
    decisions = [await limiter.check(tenant, 10) for _ in range(7)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2
    refused = decisions[-1]
    assert refused.limit_type == "requests"
    # 5 in this window, none before: room again when the window rolls over and decays
    # to 4 requests' weight: 30 s left + 60 x (1 - 4/5) = 42 s.
    assert refused.retry_after_s == pytest.approx(42.0)
    assert refused.headers()["retry-after"] == "42"
    assert refused.headers()["x-ratelimit-remaining-requests"] == "0"
    body = refused.error_body()["error"]
    assert body["code"] == "rate_limit_exceeded" and "RPM" in body["message"] and "Limit 5" in body["message"]
    assert limiter.rate_limited_total == {"finance": 2}
    clock.now += 42.5
    assert (await limiter.check(tenant, 10)).allowed


async def test_the_sliding_window_decays_the_previous_minute():
    clock = Clock(MINUTE_START + 59)
    limiter = RateLimiter(MemoryStateStore(), clock)
    tenant = Tenant("t", requests_per_minute=10)
    for _ in range(10):
        assert (await limiter.check(tenant, 0)).allowed
    clock.now = MINUTE_START + 60 + 30  # half-way into the next window: 10 x 0.5 = 5 still count
    admitted = sum([(await limiter.check(tenant, 0)).allowed for _ in range(10)])
    assert admitted == 5


async def test_tokens_per_minute_count_prompt_and_generated_tokens():
    clock = Clock(MINUTE_START + 10)
    limiter = RateLimiter(MemoryStateStore(), clock)
    tenant = Tenant("t", tokens_per_minute=1000)
    assert (await limiter.check(tenant, 400)).allowed
    limiter.record_tokens(tenant, 500)  # completion tokens
    refused = await limiter.check(tenant, 200)
    assert not refused.allowed and refused.limit_type == "tokens"
    assert "TPM" in refused.error_body()["error"]["message"]
    assert refused.headers()["x-ratelimit-remaining-tokens"] == "100"
    assert (await limiter.check(tenant, 100)).allowed


async def test_a_request_larger_than_the_token_limit_can_never_run():
    limiter = RateLimiter(MemoryStateStore(), Clock(MINUTE_START))
    decision = await limiter.check(Tenant("t", tokens_per_minute=100), 101)
    assert not decision.allowed and decision.retry_after_s is None
    assert "retry-after" not in decision.headers()
    assert "Request too large" in decision.error_body()["error"]["message"]


async def test_tenants_without_limits_are_never_refused_and_never_counted():
    store = MemoryStateStore()
    limiter = RateLimiter(store, Clock(MINUTE_START))
    for _ in range(1000):
        assert (await limiter.check(Tenant("free"), 10_000)).allowed
    assert not store._windows.mine


async def test_tenants_are_limited_independently():
    limiter = RateLimiter(MemoryStateStore(), Clock(MINUTE_START + 1))
    a, b = Tenant("a", requests_per_minute=1), Tenant("b", requests_per_minute=1)
    assert (await limiter.check(a, 0)).allowed
    assert not (await limiter.check(a, 0)).allowed
    assert (await limiter.check(b, 0)).allowed


@pytest.mark.parametrize(("counts", "fraction", "limits", "tokens", "expected"), [
    (WindowCounts(0, 0, 0, 0), 0.5, Limits(1, None), 0, 0.0),
    (WindowCounts(2, 0, 4, 0), 0.5, Limits(4, None), 0, 15.0),  # 4 x (0.5 - dt/60) + 2 <= 3
    (WindowCounts(5, 0, 0, 0), 0.0, Limits(5, None), 0, 60.0 + 12.0),
    (WindowCounts(0, 900, 0, 0), 0.25, Limits(None, 1000), 200, 45.0 + 60.0 / 9),  # 900 x (1 - f) <= 800
    (WindowCounts(0, 0, 0, 0), 0.0, Limits(None, 1000), 1001, None),
])
def test_retry_after_arithmetic(counts, fraction, limits, tokens, expected):
    wait = retry_after(counts, fraction, limits, tokens)
    assert wait == (None if expected is None else pytest.approx(expected))
