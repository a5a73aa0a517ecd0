"""`make services` (part of `make test`): what it would install and how, run as a dry run on a PATH
without the server binaries (nothing is installed; the real install is the same commands run)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.packaging.chart import ROOT

SERVERS = ("redis-server", "prometheus", "prometheus-alertmanager")


def make_services(tmp_path: Path, present: tuple[str, ...] = (), policy_exists: bool = False) -> list[str]:
    """The dry run's output lines, on a PATH holding only bash, id and the `present` servers (stubs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for server in present:
        (bin_dir / server).write_text("#!/bin/sh\n")
        (bin_dir / server).chmod(0o755)
    policy = tmp_path / "policy-rc.d"
    if policy_exists:
        policy.write_text("#!/bin/sh\nexit 101\n")
    done = subprocess.run([shutil.which("make"), "-s", "-C", str(ROOT), "services"], capture_output=True, text=True,
                          timeout=60, env={"PATH": str(bin_dir), "SITS_SERVICES_DRY_RUN": "1",
                                           "SITS_POLICY_RC": str(policy), "HOME": os.environ.get("HOME", "/")})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_missing_servers_are_installed_without_recommends_and_their_services_never_run(tmp_path):
    lines = make_services(tmp_path)
    assert lines[0] == ("make test: installing redis-server prometheus prometheus-alertmanager from Debian (apt-get, "
                        "--no-install-recommends; their system services are left disabled and stopped)")
    commands = [line.removeprefix("+ ") for line in lines[1:]]
    policy = tmp_path / "policy-rc.d"
    install = "apt-get install -y -q --no-install-recommends redis-server prometheus prometheus-alertmanager"
    # services may not start during the install (invoke-rc.d obeys policy-rc.d's 101), and the policy goes after
    assert commands.index(install) > next(i for i, c in enumerate(commands) if f"exit 101\\n' > {policy}" in c)
    assert commands[-1] == f"rm -f {policy}"
    for server in SERVERS:
        assert commands.index(f"systemctl disable --quiet {server}.service") > commands.index(install)
        assert f"systemctl stop {server}.service" in commands
    assert not any("recommends" in c and "--no-install-recommends" not in c for c in commands)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_only_what_is_missing_is_installed_and_an_existing_policy_is_left_alone(tmp_path):
    lines = make_services(tmp_path, present=("prometheus",), policy_exists=True)
    assert lines[0].startswith("make test: installing redis-server prometheus-alertmanager from Debian")
    assert "+ apt-get install -y -q --no-install-recommends redis-server prometheus-alertmanager" in lines
    assert not [line for line in lines if "policy-rc.d" in line]  # the machine's own policy stays
    assert not [line for line in lines if "prometheus.service" in line]  # not ours: left as it is


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_nothing_is_done_or_said_when_every_server_is_there(tmp_path):
    assert make_services(tmp_path, present=SERVERS) == []
