"""`sits serve` tenancy flags: a bad tenants file or option is one line on stderr and exit code 2,
before any model is loaded."""

from __future__ import annotations

import pytest

from sits.runtime import cli

GOOD = 'tenants: [{name: finance, apiKey: "sk-1", kvCacheShare: 0.5}]'


@pytest.mark.parametrize(("content", "extra", "expected"), [
    (None, [], "cannot read tenants file"),
    ("tenants: [{name: finance, apiKey: sk-1}", [], "not valid YAML"),
    ("tenants: [{name: finance}]", [], 'tenant "finance": apiKey or apiKeySha256 is required'),
    ('tenants: [{name: a, apiKey: "k1", kvCacheShare: 0.7}, {name: b, apiKey: "k2", kvCacheShare: 0.5}]', [],
     "kvCacheShare values sum to 1.2"),
    ('tenants: [{name: a, apiKey: "k1", priority: 9}]', [], "priority must be between 0 and 3"),
    ('tenants: [{name: a, apiKey: "k1", requestsPerMinut: 5}]', [], "unknown field(s) requestsPerMinut"),
    (GOOD, ["--state-store", "mysql://db:3306"], "--state-store must be memory:// or redis://"),
    (GOOD, ["--deployment", "has space"], "--deployment"),
    (GOOD, ["--eviction-alpha", "-1"], "--eviction-alpha"),
    (GOOD, ["--eviction-ttl", "-3"], "--eviction-ttl"),
    (None, ["--trusted-gateway-header", "X-Tenant"], "--trusted-gateway-header needs --tenants"),
], ids=["missing", "yaml", "no-key", "shares", "priority", "typo", "store", "deployment", "alpha", "ttl", "gateway"])
def test_bad_tenancy_input_is_one_line_and_exit_2(tmp_path, capsys, content, extra, expected):
    argv = ["serve", "--port", "0", *extra]
    if content is not None or not extra:
        path = tmp_path / "tenants.yaml"
        if content is not None:
            path.write_text(content)
        argv += ["--tenants", str(path)]
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("sits serve: error: ") and expected in lines[0]


def test_a_redis_password_never_reaches_the_error_line(capsys):
    code = cli.main(["serve", "--port", "0", "--state-store", "mysql://admin:hunter2@db:3306"])
    err = capsys.readouterr().err
    assert code == 2 and "hunter2" not in err
