"""`python -m sits.operator` and the `sits operator` subcommand."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import urllib.request

from sits.operator.__main__ import config_from_args, main, register, run
from tests.operator.helpers import WEBHOOK_TOKEN, post_alerts, sitsdeployment, wait_for, wait_for_status
from tests.support.services import free_port, wait_for_port


def test_the_subcommand_registers_with_the_sits_cli_and_parses_its_flags():
    parser = argparse.ArgumentParser(prog="sits")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["operator", "--namespace", "llm", "--webhook-port", "9000", "--resync-interval", "2"])
    assert args.handler is run
    config = config_from_args(args)
    assert (config.namespace, config.webhook_port, config.resync_interval_s) == ("llm", 9000, 2.0)
    defaults = config_from_args(parser.parse_args(["operator"]))
    assert (defaults.namespace, defaults.webhook_port, defaults.health_port) == (None, 8081, 8080)


def test_sits_operator_is_a_subcommand_of_the_sits_command(capsys):
    from sits.runtime.cli import main as sits_main

    assert sits_main(["operator", "--webhook-port", "70000"]) == 2
    assert capsys.readouterr().err.strip() == "sits operator: error: --webhook-port must be between 0 and 65535, got 70000"
    with_help = subprocess.run([sys.executable, "-m", "sits.runtime", "operator", "--help"], capture_output=True,
                               text=True, timeout=60)
    assert with_help.returncode == 0 and "--webhook-port" in with_help.stdout


def test_bad_flags_are_one_line_errors(capsys):
    assert main(["--webhook-port", "70000"]) == 2
    assert capsys.readouterr().err.strip() == "sits operator: error: --webhook-port must be between 0 and 65535, got 70000"
    assert main(["--resync-interval", "0"]) == 2


def test_webhook_token_flags(tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="sits")
    register(parser.add_subparsers(dest="command"))
    monkeypatch.delenv("SITS_WEBHOOK_TOKEN", raising=False)
    config = config_from_args(parser.parse_args(["operator"]))
    assert (config.webhook_token_file, config.webhook_token, config.webhook_allow_unauthenticated) == (None, None, False)
    monkeypatch.setenv("SITS_WEBHOOK_TOKEN", WEBHOOK_TOKEN)
    config = config_from_args(parser.parse_args(["operator", "--webhook-allow-unauthenticated"]))
    assert (config.webhook_token, config.webhook_allow_unauthenticated) == (WEBHOOK_TOKEN, True)
    assert WEBHOOK_TOKEN not in repr(config)
    token_file = tmp_path / "token"
    token_file.write_text(WEBHOOK_TOKEN)
    assert main(["--webhook-token-file", str(token_file)]) == 2  # and $SITS_WEBHOOK_TOKEN: which one?
    assert capsys.readouterr().err.strip() == \
        "sits operator: error: give --webhook-token-file or $SITS_WEBHOOK_TOKEN, not both"
    monkeypatch.setenv("SITS_WEBHOOK_TOKEN", "short")
    assert main([]) == 2
    assert "from $SITS_WEBHOOK_TOKEN has 5 characters; at least 16" in capsys.readouterr().err
    monkeypatch.delenv("SITS_WEBHOOK_TOKEN")
    assert main(["--webhook-token-file", str(tmp_path / "missing")]) == 2
    assert "cannot read the webhook token file" in capsys.readouterr().err


def get_json(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, json.loads(response.read() or b"{}")


def test_python_m_sits_operator_runs_until_sigterm(cluster, kube, deployments, tmp_path):
    for namespace in ("llm", "other"):  # kopf waits for a --namespace to exist
        kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": namespace}})
    webhook, health = free_port(), free_port()
    token_file = tmp_path / "token"
    token_file.write_text(WEBHOOK_TOKEN + "\n")  # as a mounted Secret may hold it
    argv = [sys.executable, "-m", "sits.operator", "--namespace", "llm", "--listen-host", "127.0.0.1",
            "--webhook-port", str(webhook), "--webhook-token-file", str(token_file),
            "--health-port", str(health), "--resync-interval", "0.3"]
    with open(tmp_path / "operator.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    try:
        wait_for_port(webhook, timeout_s=30, process=process)
        kube.create(sitsdeployment("cli"))
        kube.create(sitsdeployment("elsewhere", namespace="other"))
        wait_for_status(kube, "cli", lambda s: s.get("phase") == "Healthy", timeout_s=30, what="Healthy")
        assert get_json(f"http://127.0.0.1:{webhook}/healthz") == (200, {"status": "ok"})
        assert post_alerts(webhook, {"alerts": []}, token=None)[0] == 401
        assert post_alerts(webhook, {"alerts": []}) == (200, {"status": "received"})
        assert wait_for(lambda: get_json(f"http://127.0.0.1:{health}/healthz")[0] == 200, what="the liveness endpoint")
        with urllib.request.urlopen(f"http://127.0.0.1:{health}/metrics", timeout=5) as response:
            metrics = response.read().decode()
        assert 'sits_rollout_phase{namespace="llm",phase="Healthy",sitsdeployment="cli"} 1.0' in metrics
        assert 'sitsdeployment="elsewhere"' not in metrics and "process_resident_memory_bytes" in metrics
        assert kube.get("apps/v1", "Deployment", "other", "elsewhere-stable") is None, "--namespace restricts it"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert code == 0, (tmp_path / "operator.log").read_text()[-3000:]
