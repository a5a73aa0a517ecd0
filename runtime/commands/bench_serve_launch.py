"""`sits bench serve --launch "serve args"`: a local `sits serve` for the length of one benchmark.

The server runs as `python -m sits.runtime.cli serve ARGS --host 127.0.0.1 --port P` (P free) in
a session of its own, so stopping it reaches every process it started; it is stopped with SIGTERM
(the server drains and exits), then SIGKILL for the whole group after a grace period, on every
way out of the `with` block: normal end, error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

STOP_GRACE_S = 30.0


class LaunchError(RuntimeError):
    """The local server did not come up (its exit code and the tail of its log are in the message)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_argv(serve_args: str, port: int) -> list[str]:
    """The command line; --host / --port in serve_args are refused (the benchmark picks them)."""
    args = shlex.split(serve_args)
    if any(a in ("--host", "--port") or a.startswith(("--host=", "--port=")) for a in args):
        raise LaunchError("--launch: leave out --host and --port (the server listens on a free 127.0.0.1 port)")
    return [sys.executable, "-m", "sits.runtime.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LaunchError(f"--launch: the server exited with {process.returncode} before it was healthy: "
                              f"{_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise LaunchError(f"--launch: the server was not healthy within {timeout_s:.0f} s: {_tail(log)}")


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:]) or "(no output)"


def stop(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's process group, wait, then SIGKILL whatever of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # children the server may have left
    process.wait()


@contextlib.contextmanager
def launched(serve_args: str, extra_files: dict[str, str] | None = None,
             health_timeout_s: float = 600.0) -> Iterator[str]:
    """Start `sits serve serve_args` and yield its root URL; stop it on the way out.

    `extra_files`: {flag: file contents} written to a temporary file passed as `flag FILE` (e.g. a
    generated tenants file for --tenants). The server's log goes to a temporary file (its tail is in
    LaunchError's message when it fails to start).
    """
    with tempfile.TemporaryDirectory(prefix="sits-bench-serve-") as workdir:
        args = serve_args
        for index, (flag, contents) in enumerate((extra_files or {}).items()):
            path = Path(workdir) / f"extra-{index}"
            path.write_text(contents)
            args += f" {flag} {shlex.quote(str(path))}"
        port = free_port()
        argv = serve_argv(args, port)
        log = Path(workdir) / "serve.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_healthy(url, process, health_timeout_s, log)
                yield url
            finally:
                stop(process)
