"""Which tenant sent a request: from its API key, from a trusted gateway's header, or nobody asks.

Three modes:
- open: no --tenants; every request is the `default` tenant (the local default).
- api_key: every /v1/* call needs `Authorization: Bearer <key>`; a missing or unknown key is a
  401 in OpenAI's error shape. Keys are compared by digest in constant time and never logged.
- trusted_gateway: a gateway in front of the server already authenticated the caller and names
  the tenant in a header (off by default: only safe when clients cannot reach the server directly).

The server calls `Authenticator.authenticate(headers)` and turns `AuthenticationError` into a 401
with `error.body()` as the JSON.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

from sits.runtime.tenancy.tenants import Tenant, TenantTable

DEFAULT_GATEWAY_HEADER = "x-sits-tenant"


class AuthMode(enum.StrEnum):
    OPEN = "open"
    API_KEY = "api_key"
    TRUSTED_GATEWAY = "trusted_gateway"


class AuthenticationError(Exception):
    """The request names no tenant, or a wrong one: HTTP 401.

    The message never contains the presented key, not even a part of it.
    """

    status_code = 401

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def body(self) -> dict[str, Any]:
        """OpenAI's error JSON for a 401."""
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": None,
                          "code": self.code}}


MISSING_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization "
               "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
WRONG_KEY = "Incorrect API key provided."


class Authenticator:
    """Maps request headers to a Tenant.

    Args:
        tables: the current TenantTable, or a callable returning it (so a live update of the table
            takes effect on the next request without rebuilding the authenticator).
        mode: see the module docstring; defaults to open for `TenantTable.open_access()` and
            api_key otherwise.
        gateway_header: the header a trusted gateway sets to the tenant's name.
    """

    def __init__(self, tables: TenantTable | Callable[[], TenantTable], mode: AuthMode | None = None,
                 gateway_header: str = DEFAULT_GATEWAY_HEADER) -> None:
        self._table = tables if callable(tables) else (lambda: tables)
        if mode is None:
            mode = AuthMode.API_KEY if self._table().requires_auth else AuthMode.OPEN
        self.mode = mode
        self.gateway_header = gateway_header.lower()

    def __repr__(self) -> str:
        return f"Authenticator(mode={self.mode.value}, gateway_header={self.gateway_header!r})"

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request with these headers; raises AuthenticationError (a 401)."""
        table = self._table()
        if self.mode is AuthMode.OPEN:
            return next(iter(table))
        if self.mode is AuthMode.TRUSTED_GATEWAY:
            name = _header(headers, self.gateway_header)
            tenant = table.get(name.strip()) if name else None
            if tenant is None:
                raise AuthenticationError(f"The gateway header {self.gateway_header} names no known tenant.",
                                          "invalid_tenant")
            return tenant
        key = bearer_token(_header(headers, "authorization"))
        if key is None:
            raise AuthenticationError(MISSING_KEY, None)
        tenant = table.by_key(key)
        if tenant is None:
            raise AuthenticationError(WRONG_KEY, "invalid_api_key")
        return tenant


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of an `Authorization: Bearer <token>` header (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive header lookup for Starlette's Headers and plain dicts alike."""
    value = headers.get(name)
    if value is not None:
        return value
    for key, candidate in headers.items():
        if key.lower() == name:
            return candidate
    return None
