"""Real services (Redis, Prometheus, Alertmanager, our own server) started on 127.0.0.1 and free ports.

Every process started here is stopped by the same context manager that started it, so no test
leaves a server behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 30.0, process: subprocess.Popen | None = None,
                  host: str = "127.0.0.1") -> None:
    """Block until host:port (a loopback address) accepts connections; raise if the process died or time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process {process.args[0]} exited with {process.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout_s} s")


def python_tool(name: str) -> str | None:
    """The console script `name` installed beside this interpreter (the venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed; `make test` installs it (apt-get install -y {name})")
    return path


@dataclass
class RunningService:
    """A started process and the port it listens on."""

    process: subprocess.Popen
    port: int
    workdir: Path
    host: str = "127.0.0.1"  # a loopback address: several services may share a port on 127.0.0.2, .3, ...

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL at once (fault-injection tests)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def started(argv: list[str], port: int, *, workdir: Path | None = None, env: dict[str, str] | None = None,
            timeout_s: float = 30.0, log_name: str = "service.log", host: str = "127.0.0.1") -> Iterator[RunningService]:
    """Start argv, wait until it listens on port, yield it, and always stop it afterwards."""
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="sits-svc-")) if own_dir else workdir
    log = open(workdir / log_name, "wb")  # noqa: SIM115 - closed in finally
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                               env={**os.environ, **(env or {})})
    service = RunningService(process=process, port=port, workdir=workdir, host=host)
    try:
        try:
            wait_for_port(port, timeout_s, process, host)
        except Exception as error:
            log.flush()
            tail = (workdir / log_name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{argv[0]} did not start: {error}\n{tail}") from error
        yield service
    finally:
        service.stop()
        log.close()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def redis_argv(port: int) -> list[str]:
    return [require_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "no"]


@contextlib.contextmanager
def redis_server(port: int | None = None) -> Iterator[RunningService]:
    """A real redis-server in the foreground on 127.0.0.1 (kill it and start it again on the same port)."""
    port = port or free_port()
    with started(redis_argv(port), port, log_name="redis.log") as service:
        yield service


@contextlib.contextmanager
def prometheus_server(config_yaml: str, rules_yaml: str | None = None) -> Iterator[RunningService]:
    """A real Prometheus with the given config (and optional rules file named `rules.yml`)."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="sits-prom-"))
    try:
        (workdir / "prometheus.yml").write_text(config_yaml)
        if rules_yaml is not None:
            (workdir / "rules.yml").write_text(rules_yaml)
        argv = [require_binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle"]
        with started(argv, port, workdir=workdir, log_name="prometheus.log") as service:
            yield service
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def alertmanager_server(config_yaml: str) -> Iterator[RunningService]:
    """A real Alertmanager with the given config, cluster mode off."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="sits-am-"))
    try:
        (workdir / "alertmanager.yml").write_text(config_yaml)
        argv = [require_binary("prometheus-alertmanager"), f"--config.file={workdir / 'alertmanager.yml'}",
                f"--storage.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address="]
        with started(argv, port, workdir=workdir, log_name="alertmanager.log") as service:
            yield service
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
