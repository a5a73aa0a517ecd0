"""Tenants file validation, key lookup, salts, and keys never shown."""

from __future__ import annotations

import hashlib
import logging

import pytest

from sits.runtime.tenancy.tenants import (
    SHARED_PREFIX_SALT,
    Tenant,
    TenantConfigError,
    TenantTable,
    load_tenants_file,
    parse_tenants,
)

FINANCE_KEY = "sk-finance-0123456789abcdef"
RESEARCH_KEY = "sk-research-fedcba9876543210"

TENANTS_YAML = f"""
tenants:
  - {{name: finance, apiKey: "{FINANCE_KEY}", priority: 3, kvCacheShare: 0.4,
     requestsPerMinute: 600, tokensPerMinute: 200000}}
  - name: research
    apiKeySha256: "{hashlib.sha256(RESEARCH_KEY.encode()).hexdigest()}"
    priority: 1
    kvCacheShare: 0.2
    weight: 2
"""


@pytest.fixture
def table(tmp_path) -> TenantTable:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    return load_tenants_file(path)


def test_file_is_parsed_into_tenants(table):
    finance, research = table.get("finance"), table.get("research")
    assert (finance.priority, finance.kv_cache_share, finance.requests_per_minute, finance.tokens_per_minute) == (
        3, 0.4, 600, 200000)
    assert (research.priority, research.kv_cache_share, research.requests_per_minute, research.weight) == (
        1, 0.2, None, 2.0)
    assert table.requires_auth and not table.shared_prefix_pool
    assert table.shares() == {"finance": 0.4, "research": 0.2}
    assert table.priorities() == {"finance": 3, "research": 1}


def test_keys_map_to_tenants_by_plaintext_or_digest(table):
    assert table.by_key(FINANCE_KEY).name == "finance"
    assert table.by_key(RESEARCH_KEY).name == "research"  # configured as apiKeySha256
    assert table.by_key("sk-wrong") is None
    assert table.by_key(FINANCE_KEY + " ") is None
    assert table.by_key("") is None


def test_no_key_in_repr_str_or_document(table, caplog):
    caplog.set_level(logging.DEBUG)
    digest = hashlib.sha256(FINANCE_KEY.encode()).digest()
    texts = [repr(table), str(table), repr(table.get("finance")), str(table.get("finance")), repr(list(table))]
    for text in texts:
        assert FINANCE_KEY not in text and RESEARCH_KEY not in text
        assert digest.hex() not in text and repr(digest) not in text  # not even the digest
    assert FINANCE_KEY not in caplog.text


def test_document_round_trips_with_digests_only(table):
    document = table.to_document()
    assert FINANCE_KEY not in repr(document)
    again = parse_tenants(document)
    assert again.by_key(FINANCE_KEY).name == "finance"
    assert [t for t in again] == [t for t in table]


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("tenants: [{name: a, apiKey: k1}, {name: a, apiKey: k2}]", 'tenant "a" appears twice'),
    ("tenants: [{name: a, apiKey: same}, {name: b, apiKey: same}]", 'tenants "a" and "b" have the same API key'),
    ("tenants: [{name: a, apiKey: k1, kvCacheShare: 0.6}, {name: b, apiKey: k2, kvCacheShare: 0.5}]",
     "kvCacheShare values sum to 1.1"),
    ("tenants: [{name: a, apiKey: k1, priority: 4}]", 'tenant "a": priority must be between 0 and 3, got 4'),
    ("tenants: [{name: a, apiKey: k1, priority: -1}]", 'tenant "a": priority must be between 0 and 3'),
    ("tenants: [{name: a, apiKey: k1, priority: true}]", 'tenant "a": priority must be between 0 and 3'),
    ("tenants: [{name: a, apiKey: k1, apiKeySha256: " + "a" * 64 + "}]", 'tenant "a": give apiKey or apiKeySha256, not both'),
    ("tenants: [{name: a, priority: 1}]", 'tenant "a": apiKey or apiKeySha256 is required'),
    ("tenants: [{name: a, apiKeySha256: abc}]", 'tenant "a": apiKeySha256 must be 64 hex digits'),
    ("tenants: [{name: a, apiKey: k1, kvCacheShare: 1.5}]", 'tenant "a": kvCacheShare must be between 0 and 1'),
    ("tenants: [{name: a, apiKey: k1, requestsPerMinute: 0}]", 'tenant "a": requestsPerMinute must be an integer >= 1'),
    ("tenants: [{name: a, apiKey: k1, kvcacheshare: 0.1}]", 'tenant "a": unknown field(s) kvcacheshare'),
    ("tenants: [{name: 'bad name', apiKey: k1}]", "tenants[0].name must be"),
    ("tenants: []", "`tenants:` is empty"),
    ("tenant: []", "expected a mapping with a `tenants:` list"),
])
def test_invalid_files_name_the_tenant_and_field(tmp_path, yaml_text, message):
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml_text)
    with pytest.raises(TenantConfigError) as error:
        load_tenants_file(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_errors_never_echo_keys(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants: [{name: a, apiKey: sk-secret-one}, {name: b, apiKey: sk-secret-one}]")
    with pytest.raises(TenantConfigError) as error:
        load_tenants_file(path)
    assert "sk-secret-one" not in str(error.value)


def test_shares_that_add_up_to_one_in_decimals_pass():
    table = parse_tenants({"tenants": [{"name": n, "apiKey": n, "kvCacheShare": s}
                                       for n, s in (("a", 0.1), ("b", 0.2), ("c", 0.7))]})
    assert len(table) == 3


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(TenantConfigError, match="cannot read tenants file"):
        load_tenants_file(tmp_path / "missing.yaml")
    path = tmp_path / "broken.yaml"
    path.write_text("tenants: [ {name: a")
    with pytest.raises(TenantConfigError, match="not valid YAML"):
        load_tenants_file(path)


def test_gateway_mode_tables_need_no_keys():
    table = parse_tenants({"tenants": [{"name": "a"}]}, require_keys=False)
    assert table.get("a").api_key_sha256 is None
    assert table.by_key("anything") is None


def test_prefix_salts_differ_per_tenant_and_shared_pool_is_opt_in():
    a, b = Tenant("a"), Tenant("b")
    assert a.prefix_salt != b.prefix_salt
    assert a.prefix_salt == Tenant("a", priority=3).prefix_salt  # stable: derived from the name
    closed = TenantTable([a, b])
    assert closed.prefix_salt(a, shared=True) == a.prefix_salt  # no pool configured: still private
    pooled = TenantTable([a, b], shared_prefix_pool=True)
    assert pooled.prefix_salt(a, shared=True) == pooled.prefix_salt(b, shared=True) == SHARED_PREFIX_SALT
    assert pooled.prefix_salt(a) != pooled.prefix_salt(b)


def test_open_access_table_is_one_default_tenant():
    table = TenantTable.open_access()
    assert table.names == ["default"] and not table.requires_auth
    assert table.get("default").kv_cache_share == 1.0
