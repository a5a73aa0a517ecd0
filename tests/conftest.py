"""Test-wide set-up.

Triton's interpreter must be switched on before any `@triton.jit` function is defined, so this
runs first: on a machine without a CUDA GPU every kernel test runs through TRITON_INTERPRET=1.
"""

import os

import torch

# Subprocesses started by tests (servers, the operator) run with the repository root as their
# working directory, where the `operator/` folder would shadow the standard library's module.
os.environ["PYTHONSAFEPATH"] = "1"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker would start one intra-op thread per core; on a small CI machine the
# workers then fight over the cores and CPU model tests run several times slower. Split the cores.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

import pytest  # noqa: E402

pytest_plugins = ["tests.support.fixtures"]


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped, not failed, on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
