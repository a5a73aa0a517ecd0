"""Who may read /metrics on the API port, API docs, `root` in /v1/models, and the rate-limited log of
accept errors (`sits.runtime.server.metrics_access`, `http_limits`). Real tenancy (keys from a
tenants file), a FastAPI app with the server's error handlers, and the metrics-only listener; the
whole server with --metrics-port is tests/hardening/test_http_limits.py."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sits.runtime.server.errors import install_error_handlers
from sits.runtime.server.http_limits import AcceptErrorLogFilter
from sits.runtime.server.metrics_access import (
    MetricsListener,
    api_docs_urls,
    install_metrics_route,
    public_model_root,
)
from sits.runtime.server.tenant import SingleTenantResolver
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.server_auth import TenancyResolver
from sits.runtime.tenancy.service import Tenancy

EXPOSITION = b"# TYPE sits_requests_total counter\nsits_requests_total{tenant=\"a\"} 1.0\n"


def app_with_metrics(tenants_file=None, metrics_port: int | None = None) -> TestClient:
    tenants_mode = tenants_file is not None
    app = FastAPI(**api_docs_urls(None, tenants_mode))
    install_error_handlers(app)
    if tenants_mode:
        tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(tenants_file)))
        app.state.tenant_resolver = TenancyResolver.for_tenancy(tenancy)
    else:
        app.state.tenant_resolver = SingleTenantResolver()
    install_metrics_route(app, lambda: EXPOSITION, tenants_mode=tenants_mode, metrics_port=metrics_port)
    return TestClient(app)


@pytest.fixture
def tenants_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text('tenants:\n  - {name: ops, apiKey: "sk-ops", admin: true}\n  - {name: app, apiKey: "sk-app"}\n')
    return path


def test_with_tenants_metrics_need_an_admins_key_and_docs_are_off(tenants_file):
    client = app_with_metrics(tenants_file)
    assert client.get("/metrics").status_code == 401
    other = client.get("/metrics", headers={"Authorization": "Bearer sk-app"})
    assert other.status_code == 403 and other.json()["error"]["code"] == "permission_denied"
    admin = client.get("/metrics", headers={"Authorization": "Bearer sk-ops"})
    assert admin.status_code == 200 and admin.content == EXPOSITION
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 404


def test_without_tenants_metrics_and_docs_stay_open_unless_a_metrics_port_serves_them():
    client = app_with_metrics()
    assert client.get("/metrics").content == EXPOSITION
    assert client.get("/openapi.json").status_code == 200
    assert app_with_metrics(metrics_port=9100).get("/metrics").status_code == 404
    assert api_docs_urls(True, tenants_mode=True)["openapi_url"] == "/openapi.json"  # --enable-api-docs


def test_the_metrics_listener_serves_metrics_and_nothing_else():
    with MetricsListener("127.0.0.1", 0, lambda: EXPOSITION) as listener:
        url = f"http://127.0.0.1:{listener.port}"
        assert httpx.get(f"{url}/metrics").content == EXPOSITION
        assert httpx.get(f"{url}/v1/models").status_code == 404


def test_model_root_is_a_hub_id_or_the_name_never_a_path():
    assert public_model_root("hf://org/model@main", "m") == "hf://org/model@main"
    assert public_model_root("/srv/models/llama", "llama") == "llama"
    assert public_model_root(None, "llama") == "llama"


def test_accept_errors_are_logged_once_per_interval_with_a_count(caplog):
    logger = logging.getLogger("sits.test.accept")
    accept_filter = AcceptErrorLogFilter(interval_s=3600)
    logger.addFilter(accept_filter)
    try:
        with caplog.at_level(logging.ERROR, logger="sits.test.accept"):
            for _ in range(1000):
                try:
                    raise OSError(24, "Too many open files")
                except OSError:
                    logger.exception("socket.accept() out of system resource")
            logger.error("something else")
    finally:
        logger.removeFilter(accept_filter)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2 and "Too many open files" in messages[0] and messages[1] == "something else"
    assert caplog.records[0].exc_info is None and accept_filter.suppressed == 999
