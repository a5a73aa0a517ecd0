"""The engine process's spawn target, importable without the engine.

multiprocessing names a spawn target by module and function, and the parent imports that module to
hand it over. Naming `core_process.run_engine_core` made the API server import the whole engine
(torch, the models, the kernels: ~2 CPU-s and ~300 MB per server) only to start a child that imports
it again. This module is what the parent imports; only the child imports `core_process`.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from sits.runtime.config import EngineConfig


def run_engine_core(conn: Connection, config: EngineConfig, tenancy_spec: Any, parent_pid: int,
                    log_level: str) -> None:
    """The child's entry point (see core_process.run_engine_core)."""
    from sits.runtime.engine.core_process import run_engine_core as run

    run(conn, config, tenancy_spec, parent_pid, log_level)
