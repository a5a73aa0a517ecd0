"""Test-wide set-up.

Triton's interpreter must be switched on before any `@triton.jit` function is defined, so this
runs first: on a machine without a CUDA GPU every kernel test runs through TRITON_INTERPRET=1.
"""

import importlib
import os
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]


def _import_installed(name: str) -> None:
    """Import the installed distribution `name`, if there is one, before the repository's folder of that name
    can stand in for it: pytest puts the repository root first on sys.path (tests/ is a package), where
    kernels/ (sits.kernels' source) would shadow the hub's `kernels` package, which transformers >= 5.25
    requires and imports. Without an installed one nothing is imported."""
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != _ROOT]
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    finally:
        sys.path[:] = saved


_import_installed("kernels")

# Subprocesses started by tests (servers, the operator) run with the repository root as their
# working directory, where the `operator/` folder would shadow the standard library's module.
os.environ["PYTHONSAFEPATH"] = "1"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker would start one intra-op thread per core; on a small CI machine the
# workers then fight over the cores and CPU model tests run several times slower. Split the cores.
# The processes tests start (`sits serve`, its engine process, `sits generate`) get the same share through
# OMP_NUM_THREADS: with a thread per core each, their idle OpenMP threads spin on cores the other worker needs.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

import pytest  # noqa: E402

pytest_plugins = ["tests.support.fixtures"]


# The longest files (by `--durations` of a 2-core run) go first: `make test` hands each file to one of two
# workers, and a long file started last would leave the other worker idle at the end.
LONGEST_FILES_FIRST = (
    "operator/test_e2e.py", "hardening/test_fuzz_api.py", "router/test_router_replicas.py",
    "tenancy/test_serving_replicas.py", "runtime/test_bench_serve.py", "runtime/test_engine_process_failures.py",
    "hardening/test_isolation_and_secrets.py", "runtime/test_fp8_kv_cache.py", "hardening/test_load.py",
    "runtime/test_tensor_parallel_torchrun.py", "runtime/test_speculative.py", "runtime/test_engine_process.py",
)


def _file_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return LONGEST_FILES_FIRST.index(path) if path in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)


def pytest_collection_modifyitems(config, items):
    """The longest files first (a stable sort: each file's tests stay together, in order); tests marked
    `gpu` are skipped, not failed, on machines without CUDA."""
    items.sort(key=_file_rank)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
