"""Per-tenant requests-per-minute and tokens-per-minute limits, enforced across replicas.

The server calls `await limiter.check(tenant, prompt_tokens)` before it hands a request to the
engine, and answers 429 with `decision.error_body()` and `decision.headers()` (Retry-After and
OpenAI's x-ratelimit-* headers) when it is refused. Generated tokens are counted as they are
produced with `record_tokens` (no I/O; the store writes them in its next batch), so the token
limit measures tokens actually processed: prompt tokens at admission, completion tokens after.

Consistency comes from the store (see redis_store.py): exact across replicas while Redis is up
(one atomic script per admitted request, none for a tenant without limits or one already known
to be over its limit), per-replica while it is down.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sits.runtime.tenancy.rate_windows import WINDOW_S, Limits, WindowCounts, estimated_usage, retry_after
from sits.runtime.tenancy.state_store import StateStore
from sits.runtime.tenancy.tenants import Tenant


@dataclass(frozen=True)
class RateLimitDecision:
    """Whether a request may run now.

    Attributes:
        allowed: admitted (and counted).
        retry_after_s: when refused, seconds to wait before retrying: until it would be admitted,
            but never more than the window (WINDOW_S, 60 s); None if it never can (it needs more
            tokens than the per-minute limit). The sliding estimate can keep a small limit full for
            up to two windows (the last window's count still weighs on the next one), while
            everything it counts is older than one window by then: a client told to come back
            after one window and refused again is told the (short) rest.
        limit_type: which limit refused it: "requests" or "tokens".
    """

    allowed: bool
    tenant: str
    retry_after_s: float | None = None
    limit_type: str | None = None
    limits: Limits = Limits()
    counts: WindowCounts = WindowCounts()
    fraction: float = 0.0
    requested_tokens: int = 0

    def headers(self) -> dict[str, str]:
        """Retry-After (whole seconds, at least 1) and OpenAI's x-ratelimit-* headers."""
        headers: dict[str, str] = {}
        requests_used, tokens_used = estimated_usage(self.counts, self.fraction)
        if self.limits.requests is not None:
            headers["x-ratelimit-limit-requests"] = str(self.limits.requests)
            headers["x-ratelimit-remaining-requests"] = str(max(0, math.floor(self.limits.requests - requests_used)))
        if self.limits.tokens is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.limits.tokens)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(self.limits.tokens - tokens_used)))
        if not self.allowed and self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers

    def error_body(self) -> dict[str, Any]:
        """OpenAI's 429 JSON."""
        if self.retry_after_s is None:
            message = (f"Request too large for tenant {self.tenant} on tokens per min (TPM): "
                       f"Limit {self.limits.tokens}, Requested {self.requested_tokens}. "
                       "The input or output tokens must be reduced in order to run successfully.")
        else:
            per_min = "requests per min (RPM)" if self.limit_type == "requests" else "tokens per min (TPM)"
            limit = self.limits.requests if self.limit_type == "requests" else self.limits.tokens
            message = (f"Rate limit reached for tenant {self.tenant} on {per_min}: Limit {limit}. "
                       f"Please try again in {max(1, math.ceil(self.retry_after_s))}s.")
        return {"error": {"message": message, "type": self.limit_type or "tokens", "param": None,
                          "code": "rate_limit_exceeded"}}


class RateLimiter:
    """RPM and TPM per tenant on top of a StateStore.

    Args:
        store: where the windows live (shared through Redis, or local).
        clock: wall-clock seconds (windows are numbered from the Unix epoch, so replicas agree).
    """

    def __init__(self, store: StateStore, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock
        self.rate_limited_total: dict[str, int] = defaultdict(int)

    async def check(self, tenant: Tenant, prompt_tokens: int) -> RateLimitDecision:
        """Admit and count one request of prompt_tokens tokens, or refuse it with a retry time."""
        limits = Limits(tenant.requests_per_minute, tenant.tokens_per_minute)
        if limits.requests is None and limits.tokens is None:
            return RateLimitDecision(True, tenant.name)  # no limits: no round trip
        if limits.tokens is not None and prompt_tokens > limits.tokens:
            self.rate_limited_total[tenant.name] += 1
            return RateLimitDecision(False, tenant.name, None, "tokens", limits, requested_tokens=prompt_tokens)
        admission = await self._store.admit(tenant.name, self._clock(), limits, prompt_tokens)
        if admission.allowed:
            return RateLimitDecision(True, tenant.name, limits=limits, counts=admission.counts,
                                     fraction=admission.fraction, requested_tokens=prompt_tokens)
        self.rate_limited_total[tenant.name] += 1
        requests_only = Limits(limits.requests, None)
        wait_requests = retry_after(admission.counts, admission.fraction, requests_only, prompt_tokens) or 0.0
        wait = retry_after(admission.counts, admission.fraction, limits, prompt_tokens)
        limit_type = "requests" if limits.requests is not None and wait_requests >= (wait or 0.0) else "tokens"
        # A refusal decided on counts another replica just raised can compute 0: never say "now";
        # and never ask for more than a window (OpenAI's client ignores a Retry-After over 60 s)
        wait_s = min(max(wait or 0.0, 1.0), WINDOW_S)
        return RateLimitDecision(False, tenant.name, wait_s, limit_type, limits, admission.counts,
                                 admission.fraction, prompt_tokens)

    def record_tokens(self, tenant: Tenant, num_tokens: int) -> None:
        """Count generated tokens against the tenant's token limit; returns at once."""
        if tenant.tokens_per_minute is not None and num_tokens > 0:
            self._store.add_window_tokens(tenant.name, self._clock(), num_tokens)
