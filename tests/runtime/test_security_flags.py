"""`sits serve`'s security flags (docs/security.md): defaults, and each bad value a one-line error
(exit 2) before the model loads; a taken --metrics-port fails as fast as a taken --port."""

from __future__ import annotations

import socket

import pytest

from sits.runtime import cli
from sits.runtime.server.grammar_compiler import GrammarLimits
from sits.runtime.server.security import security_from_args


def parse(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


def test_defaults_and_parsed_values(tmp_path):
    security = security_from_args(parse())
    assert security.grammar == GrammarLimits() and security.metrics_port is None and security.lora_roots == ()
    assert security.api_docs is None and security.http.header_timeout_s == 15.0
    security = security_from_args(parse("--lora-root", str(tmp_path), "--lora-root", str(tmp_path / "."),
                                        "--metrics-port", "9100", "--no-enable-api-docs", "--grammar-max-depth", "8",
                                        "--http-max-connections", "100"))
    assert security.lora_roots == (tmp_path.resolve(), tmp_path.resolve()) and security.metrics_port == 9100
    assert security.api_docs is False and security.grammar.max_depth == 8 and security.http.max_connections == 100


@pytest.mark.parametrize("flags, needle", [
    (("--lora-root", "/no/such/directory"), "--lora-root"),
    (("--metrics-port", "70000"), "--metrics-port"),
    (("--grammar-compile-timeout", "0"), "compile_timeout_s"),
    (("--grammar-compile-workers", "0"), "workers"),
    (("--http-header-timeout", "-1"), "header_timeout_s"),
])
def test_a_bad_value_is_a_one_line_error(flags, needle, capsys):
    assert cli.main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sits serve: error:") and needle in err and "\n" not in err


def test_a_taken_metrics_port_fails_before_loading_the_model(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = cli.main(["serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", str(busy.getsockname()[1])])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sits serve: error: --metrics-port: cannot listen on 127.0.0.1:") and "\n" not in err
