"""Which tenant a request belongs to, decided in one place: `TenantGate`, before the body is read.

A `TenantResolver` on `app.state.tenant_resolver` answers these questions:
- `resolve(request)`: who is calling (API key -> tenant), as a typed `RequestTenant` (name, scheduling
  priority, the tenants-file entry); raises `OpenAIError(401)` for a missing or unknown key. The gate
  leaves it in the request state, the one place handlers, metrics and the admin checks read it from
  (`tenant_of`);
- `admit(request, tenant)`: may this generation request run now; raises `OpenAIError(429)` with
  Retry-After for a tenant over its rate limit;
- `cache_salt(request, shared)`: the prefix-cache salt of the request's prompts, so tenants never
  share cached KV (`shared`: the prompt is marked for the shared-prefix pool; 400 where none is);
- `allowed_models(request)`: the model ids the tenant may use (None: every served model); the
  others answer as models that do not exist (`request_allowed_models`, `ServingContext.check_model`).

`TenantGate` runs the first two for every /v1/* request (and /tokenize, /detokenize, which expose
the deployment's chat template and vocabulary) before FastAPI reads the body, so an
unauthenticated request with a malformed body gets 401, not 400 (what OpenAI does). Without
tenancy every request is the tenant "default": open (`SingleTenantResolver`) or behind
`sits serve --api-key` (`ApiKeyResolver`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from sits.runtime.server.admission import AdmissionControl
from sits.runtime.server.errors import OpenAIError, invalid_request
from sits.runtime.tenancy.auth import Authenticator, AuthMode
from sits.runtime.tenancy.tenants import Tenant, TenantTable, api_key_digest

DEFAULT_TENANT = "default"
UNRESOLVED_TENANT = "unknown"  # the metrics label of a request rejected before its tenant was known
API_PREFIX = "/v1/"
AUTHENTICATED_PATHS = frozenset({"/tokenize", "/detokenize"})  # outside /v1/, yet behind the same keys


@dataclass(frozen=True)
class RequestTenant:
    """Who a request runs for, as its `TenantResolver` found it (in the request state under `tenant`).

    Attributes:
        name: the tenant's name: the engine's tenant, the `tenant` label of the metrics.
        priority: scheduling priority, 0 (lowest) to 3; 0 without tenants.
        record: the tenant's entry of the tenants file (allow-list, admin flag, limits); None when
            the server runs without --tenants.
    """

    name: str
    priority: int = 0
    record: Tenant | None = None

    @property
    def admin(self) -> bool:
        """May call the operator endpoints (`admin: true` in the tenants file)."""
        return self.record is not None and self.record.admin

    @property
    def allowed_models(self) -> tuple[str, ...] | None:
        """The model ids this tenant may use; None for every served model."""
        return None if self.record is None else self.record.models


def tenant_of(request: Request) -> RequestTenant | None:
    """The request's tenant, once `TenantGate` (or `request_tenant`) resolved it; None before."""
    return getattr(request.state, "tenant", None)


class TenantResolver(Protocol):
    async def resolve(self, request: Request) -> RequestTenant:
        """Who this request runs for, or raise OpenAIError (401 / 403)."""
        ...

    async def admit(self, request: Request, tenant: str) -> None:
        """Raise OpenAIError(429) when `tenant` may not start another generation request now."""
        ...

    def cache_salt(self, request: Request, shared: bool) -> str | None:
        """The prefix-cache salt of this request's prompts; raise OpenAIError(400) for a refused `shared`."""
        ...

    def allowed_models(self, request: Request) -> Collection[str] | None:
        """The model ids this request's tenant may use; None for every model the server serves."""
        ...


class SingleTenantResolver:
    """Every request belongs to one tenant (a server without API keys); no limits, no salt."""

    def __init__(self, tenant: str = DEFAULT_TENANT) -> None:
        self.tenant = tenant

    async def resolve(self, request: Request) -> RequestTenant:
        return RequestTenant(self.tenant)

    async def admit(self, request: Request, tenant: str) -> None:
        return None

    def cache_salt(self, request: Request, shared: bool) -> str | None:
        if shared:
            raise shared_prefix_unavailable()
        return None

    def allowed_models(self, request: Request) -> Collection[str] | None:
        return None


class ApiKeyResolver(SingleTenantResolver):
    """`sits serve --api-key`: one tenant, "default", whose callers must present one of `api_keys`.

    The keys go through the tenancy code path unchanged: each becomes a digest-only entry of a
    `TenantTable` (looked up in constant time over every key, never kept in clear), and a missing or
    wrong key is the tenants mode's 401, `WWW-Authenticate: Bearer`, in OpenAI's error shape.
    No limits and no prefix-cache salt, as without keys.
    """

    def __init__(self, api_keys: Sequence[str], tenant: str = DEFAULT_TENANT) -> None:
        if not api_keys:
            raise ValueError("ApiKeyResolver needs at least one API key")
        super().__init__(tenant)
        # One table entry per key (names are internal: every caller is `tenant`).
        table = TenantTable([Tenant(f"key{index}", api_key_sha256=api_key_digest(key))
                             for index, key in enumerate(api_keys)])
        # Imported here: sits.runtime.tenancy.server_auth imports this module.
        from sits.runtime.tenancy.server_auth import TenancyResolver

        self._keys = TenancyResolver(Authenticator(table, AuthMode.API_KEY))
        self.num_keys = len(api_keys)

    def __repr__(self) -> str:
        return f"ApiKeyResolver({self.num_keys} key(s), tenant={self.tenant!r})"

    async def resolve(self, request: Request) -> RequestTenant:
        await self._keys.resolve(request)  # OpenAIError 401 for a missing or wrong key
        return RequestTenant(self.tenant)


def shared_prefix_unavailable() -> OpenAIError:
    return invalid_request("shared_prefix needs a shared-prefix pool (sharedPrefixPool: true in the tenants file)",
                           param="shared_prefix")


class TenantGate:
    """ASGI middleware: authenticate every /v1/* request and those to `AUTHENTICATED_PATHS`, and
    admit generation requests, before the body is read. The `RequestTenant` is left in the request
    state (`tenant_of`) for handlers, metrics and the admin checks.

    The order of refusals is the order a client can act on: 401 (no or wrong key), then 503 with
    Retry-After (the replica's queue is full: nothing is charged to the tenant), then 429 (the
    tenant's own limits).

    Args:
        app: the wrapped app.
        generation_paths: paths whose requests count against the tenant's rate limits.
        admission: the replica's bounded queue; a full queue refuses before the body is read
            (the handler checks again, per sequence).
    """

    def __init__(self, app: ASGIApp, generation_paths: set[str], admission: AdmissionControl | None = None) -> None:
        self.app = app
        self.generation_paths = generation_paths
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith(API_PREFIX)
                                           or scope["path"] in AUTHENTICATED_PATHS):
            await self.app(scope, receive, send)
            return
        request = Request(scope)  # headers only: the body stays unread for the endpoint
        resolver: TenantResolver = scope["app"].state.tenant_resolver
        try:
            tenant = await resolver.resolve(request)
            request.state.tenant = tenant
            if scope["path"] in self.generation_paths:
                if self.admission is not None and self.admission.full:
                    raise self.admission.overloaded()
                await resolver.admit(request, tenant.name)
        except OpenAIError as error:
            await error.to_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def request_tenant(request: Request) -> str:
    """FastAPI dependency: the name of the tenant `TenantGate` resolved (resolved here when the gate is absent)."""
    tenant = tenant_of(request)
    if tenant is None:
        tenant = await request.app.state.tenant_resolver.resolve(request)
        request.state.tenant = tenant
    return tenant.name


def request_priority(request: Request) -> int:
    """The scheduling priority of the request's tenant (0 before it was resolved)."""
    tenant = tenant_of(request)
    return 0 if tenant is None else tenant.priority


def request_cache_salt(request: Request, shared: bool = False) -> str | None:
    """The prefix-cache salt for the request's prompts (see `TenantResolver.cache_salt`)."""
    return request.app.state.tenant_resolver.cache_salt(request, shared)


def request_allowed_models(request: Request) -> Collection[str] | None:
    """The model ids the request's tenant may use, None for all (see `TenantResolver.allowed_models`)."""
    return request.app.state.tenant_resolver.allowed_models(request)
