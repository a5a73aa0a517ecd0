"""The server's TenantResolver backed by tenancy: API key (or gateway header) -> tenant, limits, salts.

`sits.runtime.server.tenant.TenantGate` calls `resolve(request)` for every /v1/* request and
`admit(request, tenant)` for generation requests, before the body is read. A missing or wrong key
raises the server's OpenAIError 401; a tenant over its RPM, or whose token window is already spent,
gets 429 with Retry-After. `resolve` answers a `RequestTenant` (name, priority, the Tenant itself),
which the gate leaves in the request state for what comes later (scheduling, cache salt, accounting).

Prompt tokens are not known yet at admission (the body is not tokenized), so the admission counts
the request with 0 tokens; the serving path adds the prompt's and the completion's tokens to the
tenant's window (`Tenancy.observe_prompt`, `Tenancy.observe_usage`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from fastapi import Request

from sits.runtime.server.errors import OpenAIError
from sits.runtime.server.tenant import RequestTenant, shared_prefix_unavailable, tenant_of
from sits.runtime.tenancy.auth import AuthenticationError, Authenticator
from sits.runtime.tenancy.limits import RateLimiter
from sits.runtime.tenancy.tenants import Tenant, TenantTable


class TenancyResolver:
    """Implements `sits.runtime.server.tenant.TenantResolver`.

    Args:
        authenticator: headers -> Tenant (401 otherwise).
        limiter: RPM / TPM admission; None admits everything.
        table: the current tenant table (for the shared-prefix pool switch and the salts); None
            refuses `shared_prefix` and salts each prompt with its tenant.
    """

    def __init__(self, authenticator: Authenticator, limiter: RateLimiter | None = None,
                 table: Callable[[], TenantTable] | None = None) -> None:
        self.authenticator = authenticator
        self.limiter = limiter
        self._table = table

    @classmethod
    def for_tenancy(cls, tenancy) -> TenancyResolver:
        """The resolver of a `sits.runtime.tenancy.service.Tenancy`."""
        return cls(tenancy.authenticator, tenancy.limiter, lambda: tenancy.table)

    async def resolve(self, request: Request) -> RequestTenant:
        try:
            tenant = self.authenticator.authenticate(request.headers)
        except AuthenticationError as error:
            raise OpenAIError(401, error.message, code=error.code, error_type="invalid_request_error",
                              headers={"WWW-Authenticate": "Bearer"}) from None
        return RequestTenant(tenant.name, tenant.priority, tenant)

    async def admit(self, request: Request, tenant: str) -> None:
        if self.limiter is None:
            return
        decision = await self.limiter.check(self._tenant(request), 0)
        if not decision.allowed:
            body = decision.error_body()["error"]
            raise OpenAIError(429, body["message"], code=body["code"], error_type=body["type"],
                              headers=decision.headers())

    def cache_salt(self, request: Request, shared: bool) -> str | None:
        tenant = self._tenant(request)
        if self._table is None:
            if shared:
                raise shared_prefix_unavailable()
            return tenant.prefix_salt
        table = self._table()
        if shared and not table.shared_prefix_pool:
            raise shared_prefix_unavailable()
        return table.prefix_salt(tenant, shared)

    def allowed_models(self, request: Request) -> Collection[str] | None:
        """The tenant's `models` allow-list as authenticated (the table current at `resolve`)."""
        return self._tenant(request).models

    @staticmethod
    def _tenant(request: Request) -> Tenant:
        resolved = tenant_of(request)
        assert resolved is not None and resolved.record is not None, "the tenant gate resolved the request"
        return resolved.record
