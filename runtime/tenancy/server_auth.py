"""The server's TenantResolver backed by tenancy: API key (or gateway header) -> tenant, then limits.

`sits.runtime.server.tenant.request_tenant` calls `resolve(request)` for every generation request.
A missing or wrong key raises the server's OpenAIError 401; a tenant over its RPM, or whose token
window is already spent, raises 429 with Retry-After. The Tenant itself is left on
`request.state.tenancy_tenant` for what comes later (priority, cache salt, token accounting).

Prompt tokens are not known yet when the resolver runs (the body is not tokenized), so the
admission here counts the request with 0 tokens; the serving path adds the prompt's and the
completion's tokens to the tenant's window with `Tenancy.record_usage` / `RateLimiter.record_tokens`.
"""

from __future__ import annotations

from fastapi import Request

from sits.runtime.server.errors import OpenAIError
from sits.runtime.tenancy.auth import AuthenticationError, Authenticator
from sits.runtime.tenancy.limits import RateLimiter


class TenancyResolver:
    """Implements `sits.runtime.server.tenant.TenantResolver`."""

    def __init__(self, authenticator: Authenticator, limiter: RateLimiter | None = None) -> None:
        self.authenticator = authenticator
        self.limiter = limiter

    async def resolve(self, request: Request) -> str:
        try:
            tenant = self.authenticator.authenticate(request.headers)
        except AuthenticationError as error:
            raise OpenAIError(401, error.message, code=error.code, headers={"WWW-Authenticate": "Bearer"}) from None
        request.state.tenancy_tenant = tenant
        if self.limiter is not None:
            decision = await self.limiter.check(tenant, 0)
            if not decision.allowed:
                request.state.tenant = tenant.name  # the 429 is counted under its tenant
                body = decision.error_body()["error"]
                raise OpenAIError(429, body["message"], code=body["code"], headers=decision.headers())
        return tenant.name
