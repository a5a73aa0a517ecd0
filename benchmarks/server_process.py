"""A server process seen from outside: start `sits serve` on a free port, read its resident memory and
the gauges that must return to zero once it is idle, and stop it (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

# Gauges that are 0 on an idle server: a sequence, KV block or admission slot still held after the
# load has ended is a leak.
IDLE_GAUGES = ("sits_requests_running", "sits_requests_waiting", "sits_kv_cache_usage_ratio",
               "sits_admission_in_flight")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process in MiB (Linux /proc), None without a pid."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def stop_process(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM, so the server shuts down cleanly; SIGKILL if it is still running after `grace_s` seconds.
    Returns once the process is reaped; a process that already exited is left as it is."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def sits_serve(args: list[str], log_path: str, timeout_s: float = 300.0) -> Iterator[tuple[str, int]]:
    """`sits serve ARGS` on 127.0.0.1 and a free port until it is healthy; yields (url, pid); always stopped."""
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"sits serve exited with {process.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sits serve was not healthy within {timeout_s} s; see {log_path}")
                time.sleep(0.2)
            yield url, process.pid
        finally:
            stop_process(process)


def engine_leftovers(url: str, api_key: str | None = None) -> dict[str, float]:
    """Sums of the gauges that must return to 0 once no request is in flight (from /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(IDLE_GAUGES, 0.0)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals
