"""One tenants schema for the runtime and the operator: the same entry from both sides, no torch imported."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from sits.operator.spec import SecretKeyRef, TenancySpec, TenantSpec
from sits.operator.tenants import resolve_tenants
from sits.runtime.tenancy.tenants import parse_tenants
from sits.runtime.tenancy.tenants_schema import ModelIdsError, model_ids


def test_the_schema_imports_neither_torch_nor_the_engine():
    """Every module the import loads, as `python -X importtime` lists them (the last column)."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c",
                          "import sits.runtime.tenancy.tenants_schema, sits.operator.tenants"],
                         capture_output=True, text=True, check=True)
    loaded = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "sits.operator.tenants" in loaded
    assert {name for name in loaded if name == "torch" or name.startswith("sits.runtime.engine")} == set()


def test_the_operator_writes_the_entry_the_runtime_writes_for_the_same_tenant():
    spec = TenancySpec(tenants=(TenantSpec(name="finance", api_key_secret_ref=SecretKeyRef("finance-key", "token"),
                                           priority=3, kv_cache_share=0.4, requests_per_minute=600,
                                           models=("base", "sql"), host_kv_cache_share=0.5),))
    secret = {"token": "c2stZmluYW5jZQ=="}  # base64 of sk-finance
    (record,) = resolve_tenants(spec, lambda name: secret).records
    written = record.to_document()
    assert list(written) == ["name", "apiKeySha256", "priority", "kvCacheShare", "requestsPerMinute", "models",
                             "hostKvCacheShare"]  # the ConfigMap's order, as before the shared writer
    runtime = parse_tenants({"tenants": [written]})  # what a replica reads from the operator's ConfigMap
    assert runtime.by_key("sk-finance").name == "finance"
    assert written["apiKeySha256"] == hashlib.sha256(b"sk-finance").hexdigest()
    again = runtime.to_document()["tenants"][0]
    assert {k: v for k, v in again.items() if k != "weight"} == written  # the runtime adds its default weight


@pytest.mark.parametrize(("value", "index", "repeated"), [
    ([], None, False), ("base", None, False), (["base", ""], 1, False), ([" base"], 0, False),
    (["base", 7], 1, False), (["sql", "sql"], 1, True)])
def test_model_id_lists_are_refused_by_one_rule(value, index, repeated):
    with pytest.raises(ModelIdsError) as refused:
        model_ids(value)
    assert (refused.value.index, refused.value.repeated) == (index, repeated)


def test_absent_model_ids_allow_every_model():
    assert model_ids(None) is None and model_ids(["base", "sql"]) == ("base", "sql")
