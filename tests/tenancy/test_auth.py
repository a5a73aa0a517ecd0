"""API-key and trusted-gateway authentication."""

from __future__ import annotations

import logging

import pytest

from sits.runtime.tenancy.auth import AuthenticationError, Authenticator, AuthMode, bearer_token
from sits.runtime.tenancy.tenants import TenantTable, parse_tenants

KEY = "sk-finance-secret-42"


@pytest.fixture
def table() -> TenantTable:
    return parse_tenants({"tenants": [{"name": "finance", "apiKey": KEY}, {"name": "lab", "apiKey": "sk-lab"}]})


def test_bearer_key_names_the_tenant(table):
    auth = Authenticator(table)
    assert auth.mode is AuthMode.API_KEY
    assert auth.authenticate({"Authorization": f"Bearer {KEY}"}).name == "finance"
    assert auth.authenticate({"authorization": "bearer sk-lab"}).name == "lab"


@pytest.mark.parametrize("headers", [{}, {"authorization": ""}, {"authorization": "Basic abc"},
                                     {"authorization": "Bearer "}])
def test_missing_key_is_401_in_openai_shape(table, headers):
    with pytest.raises(AuthenticationError) as error:
        Authenticator(table).authenticate(headers)
    body = error.value.body()
    assert error.value.status_code == 401
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Authorization" in body["error"]["message"]


def test_wrong_key_is_401_and_never_echoed(table, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-key-that-must-not-leak"
    with pytest.raises(AuthenticationError) as error:
        Authenticator(table).authenticate({"authorization": f"Bearer {wrong}"})
    assert error.value.code == "invalid_api_key"
    assert wrong not in str(error.value.body()) and wrong not in caplog.text
    assert KEY not in repr(Authenticator(table))


def test_open_mode_serves_everyone_as_default():
    auth = Authenticator(TenantTable.open_access())
    assert auth.mode is AuthMode.OPEN
    assert auth.authenticate({}).name == "default"


def test_gateway_mode_is_off_unless_asked(table):
    assert Authenticator(table).mode is AuthMode.API_KEY
    with pytest.raises(AuthenticationError):  # the header alone is not trusted by default
        Authenticator(table).authenticate({"x-sits-tenant": "finance"})
    gateway = Authenticator(table, AuthMode.TRUSTED_GATEWAY, gateway_header="X-Tenant")
    assert gateway.authenticate({"X-Tenant": "lab"}).name == "lab"
    with pytest.raises(AuthenticationError, match="names no known tenant"):
        gateway.authenticate({"x-tenant": "nobody"})
    with pytest.raises(AuthenticationError):
        gateway.authenticate({})


def test_live_table_updates_apply_to_the_next_request(table):
    current = {"table": table}
    auth = Authenticator(lambda: current["table"])
    assert auth.authenticate({"authorization": "Bearer sk-lab"}).name == "lab"
    current["table"] = parse_tenants({"tenants": [{"name": "lab", "apiKey": "sk-lab-rotated"}]})
    with pytest.raises(AuthenticationError):
        auth.authenticate({"authorization": "Bearer sk-lab"})
    assert auth.authenticate({"authorization": "Bearer sk-lab-rotated"}).name == "lab"


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("  BEARER   abc  ") == "abc"
    assert bearer_token("Token abc") is None
    assert bearer_token(None) is None
