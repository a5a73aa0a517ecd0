"""Keep the garbage collector's full collections off the serving path.

A process that imported torch, triton and the server stack holds a few hundred thousand objects that
live as long as it does (modules, functions, classes, the model's parameters). Python's generational
collector scans all of them in every full (generation 2) collection: 200-300 ms on the machines we
serve from, and on a busy engine one comes about once a second. On the H200, at 256 sequences, such a
pause stalled one decode step in about fifty (a step of ~230 ms among steps of 17 ms), which made up
the inter-token latency's p99 (`benchmarks/bench_step_trace.py` shows it).

`freeze_startup_heap()` is called once a process has started (model loaded, kernels warmed, CUDA graphs
captured; before the first request): it collects once, then moves every surviving object to the
permanent generation (`gc.freeze()`), which collections never scan. Objects made while serving (a
request's sequences, its token lists) are collected as before, and a full collection then only scans
those. vLLM and SGLang do the same for the same reason. It is a process-wide choice, so only a
process's entry point calls it (the engine process, `sits serve`, `sits bench`), never a library
constructor; `frozen_startup_heap()` unfreezes on exit, so a command run inside a test process leaves
that process collecting as before.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("sits.gc")


def freeze_startup_heap(what: str) -> int:
    """Collect, then freeze the survivors; logs and returns how many objects were frozen."""
    begin = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d start-up objects moved out of the garbage collector's scans (%.0f ms)", what, frozen,
                (time.perf_counter() - begin) * 1e3)
    return frozen


@contextmanager
def frozen_startup_heap(what: str) -> Iterator[int]:
    """`freeze_startup_heap` for the body of a command; the frozen objects are collectable again after."""
    frozen = freeze_startup_heap(what)
    try:
        yield frozen
    finally:
        gc.unfreeze()


__all__ = ["freeze_startup_heap", "frozen_startup_heap"]
