"""Fixtures of the hardening tests: a real `sits serve` process on the tiny random Llama.

A separate process (not a server thread in the test process) so its memory can be measured on its
own and a crash could not take the test runner with it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.services import RunningService, free_port, started

MAX_MODEL_LEN = 256


def serve_argv(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sits.runtime", "serve", "--model", str(model_dir), "--device", "cpu",
            "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-gb", "0.05",
            "--log-level", "info", *extra]


@contextmanager
def tiny_server(model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[RunningService]:
    """`sits serve` on the tiny model until /health answers 200; stopped (SIGTERM) afterwards."""
    port = free_port()
    with started(serve_argv(model_dir, port, *extra), port, timeout_s=120, log_name="serve.log", env=env) as service:
        deadline = time.monotonic() + 60
        while httpx.get(f"{service.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        yield service


@pytest.fixture(scope="module")
def serve_tiny(tiny_llama_dir: Path) -> Callable[..., AbstractContextManager[RunningService]]:
    """`with serve_tiny("--max-num-seqs", "4") as service:` a `sits serve` process on the tiny model."""

    def start(*extra: str, env: dict[str, str] | None = None) -> AbstractContextManager[RunningService]:
        return tiny_server(tiny_llama_dir, *extra, env=env)

    return start
