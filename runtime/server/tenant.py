"""Which tenant a request belongs to: decided in exactly one place, the `request_tenant` dependency.

Until tenancy lands every request is the tenant "default". The tenancy work plugs in by putting its
own `TenantResolver` on `app.state.tenant_resolver` (API key -> tenant); a resolver may raise
`OpenAIError(401, ...)` for a missing or unknown key and `OpenAIError(429, ...)` for a tenant over
its rate limit, and every endpoint that depends on `request_tenant` answers accordingly. A resolver
may also set `request.state.priority` (an int, 0 by default): the engine schedules by it.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import Request

DEFAULT_TENANT = "default"
UNRESOLVED_TENANT = "unknown"  # the metrics label of a request rejected before its tenant was known


class TenantResolver(Protocol):
    async def resolve(self, request: Request) -> str:
        """The tenant name for this request, or raise OpenAIError (401 / 403 / 429)."""
        ...


class SingleTenantResolver:
    """Every request belongs to one tenant (a server without API keys)."""

    def __init__(self, tenant: str = DEFAULT_TENANT) -> None:
        self.tenant = tenant

    async def resolve(self, request: Request) -> str:
        return self.tenant


async def request_tenant(request: Request) -> str:
    """FastAPI dependency: resolve the tenant and remember it on the request (metrics read it there)."""
    tenant = await request.app.state.tenant_resolver.resolve(request)
    request.state.tenant = tenant
    return tenant


def request_priority(request: Request) -> int:
    """The scheduling priority the tenant resolver left on the request (0 when it set none)."""
    return int(getattr(request.state, "priority", 0) or 0)
