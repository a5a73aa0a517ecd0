"""Real services (Redis, Prometheus, Alertmanager, our own server) started on 127.0.0.1 and free ports.

Every process started here is stopped by the same context manager that started it, so no test
leaves a server behind.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
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

LISTEN_PORTS_LOW = 10_000  # listening ports are handed out from here up to the kernel's ephemeral range
WORKER_SLICES = 8  # pytest-xdist workers get disjoint slices of that span (gw8 shares gw0's, and so on)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range: outgoing connections take their local ports from there up."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32_768


def _worker_ports() -> range:
    """This test process's slice of the listening ports (by its pytest-xdist worker number, gwN)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    span = max(1, (_ephemeral_low() - LISTEN_PORTS_LOW) // WORKER_SLICES)
    start = LISTEN_PORTS_LOW + (int(worker) if worker.isdigit() else 0) % WORKER_SLICES * span
    return range(start, start + span)


# Test-process bookkeeping, not project state: the next candidate in this process's slice, from a random
# start (two test sessions on one machine rarely overlap), so no port is handed out twice while free_port
# goes round its slice.
_PORTS = _worker_ports()
_NEXT_PORT = itertools.count(random.randrange(len(_PORTS)))


def _can_listen(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on or connects from right now, for a server to listen on.

    It comes from below the kernel's ephemeral range, so no outgoing connection (this test's or another
    process's) can hold it as its local port by the time the server binds it, and from this process's
    slice, handed out in turn, so two servers of one test never get the same one. (A port the kernel picks
    for bind(0) is ephemeral: a client connection elsewhere could take it before the server binds it.)
    """
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_NEXT_PORT) % len(_PORTS)]
        if _can_listen(port):
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}..{_PORTS.stop - 1} on 127.0.0.1")


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
