"""A tenant's `models` allow-list in the tenants file and the stored tenant table: absent allows every
served model, a list is kept in order and round-trips through the store, an empty or malformed list
is an error naming the tenant and the field (`sits serve`: one line, exit 2), and ids the server does
not serve are reported, not refused."""

from __future__ import annotations

import logging

import pytest

from sits.runtime import cli
from sits.runtime.tenancy.auth import Authenticator
from sits.runtime.tenancy.memory_store import MemoryStateStore
from sits.runtime.tenancy.tenant_sync import TenantRegistry, TenantSync
from sits.runtime.tenancy.tenants import TenantConfigError, parse_tenants


def table(*entries):
    return parse_tenants({"tenants": [dict(e) for e in entries]})


def test_absent_allows_every_model_and_a_list_only_its_ids():
    tenants = table({"name": "open", "apiKey": "sk-o"}, {"name": "narrow", "apiKey": "sk-n", "models": ["base", "sql"]})
    assert tenants.get("open").models is None and tenants.get("open").may_use("anything")
    narrow = tenants.get("narrow")
    assert narrow.models == ("base", "sql") and narrow.may_use("sql") and not narrow.may_use("poet")
    document = tenants.to_document()
    assert [t.get("models") for t in document["tenants"]] == [None, ["base", "sql"]]
    again = parse_tenants(document)  # what a replica reads back from the state store
    assert again.get("narrow").models == ("base", "sql") and again.get("open").models is None


def test_ids_the_server_does_not_serve_are_reported_per_tenant():
    tenants = table({"name": "a", "apiKey": "k1", "models": ["base", "gone", "sql"]},
                    {"name": "b", "apiKey": "k2", "models": ["base"]}, {"name": "c", "apiKey": "k3"})
    assert tenants.unserved_models({"base", "sql"}) == {"a": ["gone"]}
    assert tenants.unserved_models({"base", "sql", "gone"}) == {}


@pytest.mark.parametrize(("models", "expected"), [
    ([], 'tenant "b": models must be a non-empty list of model ids'),
    ("base", 'tenant "b": models must be a non-empty list of model ids'),
    (["base", ""], 'tenant "b": models[1] must be a model id'),
    (["base", 7], 'tenant "b": models[1] must be a model id'),
    ([" base"], 'tenant "b": models[0] must be a model id'),
    (["sql", "sql"], "tenant \"b\": models lists 'sql' twice"),
], ids=["empty", "not-a-list", "blank", "not-a-string", "spaces", "twice"])
def test_a_malformed_list_names_the_tenant_and_the_field(models, expected):
    with pytest.raises(TenantConfigError) as error:
        parse_tenants({"tenants": [{"name": "a", "apiKey": "k1"}, {"name": "b", "apiKey": "k2", "models": models}]},
                      source="tenants.yaml")
    assert str(error.value).startswith(f"tenants.yaml: {expected}")


def test_sits_serve_refuses_an_empty_list_in_one_line(tmp_path, capsys):
    path = tmp_path / "tenants.yaml"
    path.write_text('tenants: [{name: finance, apiKey: "sk-1", models: []}]')
    code = cli.main(["serve", "--port", "0", "--tenants", str(path)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"sits serve: error: {path}: tenant \"finance\": models must be a non-empty list")


async def test_a_stored_table_changes_the_list_and_a_bad_one_is_ignored(caplog):
    store = MemoryStateStore()
    seed = table({"name": "a", "apiKey": "sk-a", "models": ["base"]})
    registry = TenantRegistry(seed)
    sync = TenantSync(registry, store, poll_interval_s=60)
    await sync.start(seed)
    auth = Authenticator(lambda: registry.table)
    assert auth.authenticate({"authorization": "Bearer sk-a"}).models == ("base",)
    await store.put_tenant_table(table({"name": "a", "apiKey": "sk-a", "models": ["base", "sql"]}).to_document())
    assert await sync.poll_once()
    assert auth.authenticate({"authorization": "Bearer sk-a"}).may_use("sql")
    caplog.set_level(logging.ERROR, logger="sits.runtime.tenancy.tenant_sync")
    bad = registry.table.to_document()
    bad["tenants"][0]["models"] = []
    await store.put_tenant_table(bad)
    assert not await sync.poll_once()
    assert any('tenant "a": models must be a non-empty list' in r.getMessage() for r in caplog.records)
    assert auth.authenticate({"authorization": "Bearer sk-a"}).models == ("base", "sql")  # the last good table
    await sync.close()
