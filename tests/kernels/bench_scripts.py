"""Running a benchmarks/ script's functions inside a CPU test: its module imported as the script imports
its siblings (kernel_bench_utils), module attributes swapped for toy sizes, and wall-clock timing in place of
CUDA-graph timing."""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def wall_ms(fn, calls: int = 1) -> float:
    """Median wall milliseconds of `calls` calls of fn after one warm-up call (time_ms's stand-in on a CPU)."""
    fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def bench_script(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: object) -> Iterator[ModuleType]:
    """Yield benchmarks/<name>.py as a module with `attributes` set on it (undone after the test), then
    forget the module so the next test imports it fresh. Use from a fixture: `yield from bench_script(...)`."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports kernel_bench_utils as a sibling
    module = importlib.import_module(name)
    for attribute, value in attributes.items():
        monkeypatch.setattr(module, attribute, value)
    yield module
    sys.modules.pop(name, None)
