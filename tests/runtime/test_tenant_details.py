"""A request's tenant travels as one typed object (`RequestTenant`), not loose request-state attributes."""

from __future__ import annotations

from starlette.requests import Request

from sits.runtime.server.tenant import RequestTenant, SingleTenantResolver, request_priority, tenant_of
from sits.runtime.tenancy.auth import Authenticator, AuthMode
from sits.runtime.tenancy.server_auth import TenancyResolver
from sits.runtime.tenancy.tenants import parse_tenants


def request_with_key(key: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                    "headers": [(b"authorization", f"Bearer {key}".encode())], "state": {}})


async def test_the_tenancy_resolver_answers_the_typed_tenant_that_later_checks_read():
    table = parse_tenants({"tenants": [{"name": "lab", "apiKey": "sk-lab", "priority": 2, "admin": True,
                                        "models": ["base"]}, {"name": "guest", "apiKey": "sk-guest"}]})
    resolver = TenancyResolver(Authenticator(table, AuthMode.API_KEY), table=lambda: table)
    request = request_with_key("sk-lab")
    assert tenant_of(request) is None and request_priority(request) == 0
    tenant = await resolver.resolve(request)
    assert tenant == RequestTenant("lab", 2, table.get("lab"))
    assert tenant.admin and tenant.allowed_models == ("base",)
    request.state.tenant = tenant  # what TenantGate does
    assert tenant_of(request) is tenant and request_priority(request) == 2
    assert resolver.allowed_models(request) == ("base",) and resolver.cache_salt(request, False) == \
        table.get("lab").prefix_salt
    assert request.scope["state"] == {"tenant": tenant}  # nothing else left on the request
    guest = await resolver.resolve(request_with_key("sk-guest"))
    assert not guest.admin and guest.allowed_models is None and guest.priority == 0


async def test_without_tenants_the_tenant_has_a_name_only():
    tenant = await SingleTenantResolver().resolve(request_with_key("anything"))
    assert tenant == RequestTenant("default") and not tenant.admin and tenant.allowed_models is None
