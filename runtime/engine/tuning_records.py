"""Autotune results that Triton's own disk cache cannot keep, kept across starts.

Triton's on-disk autotune cache (TRITON_CACHE_AUTOTUNING) gives up on an autotuner whose configs
carry a pre-launch hook (it cannot serialize one): the GEMMs' split-K configs zero their output
that way and the fp8 TMA configs set their descriptors' block shapes. Without a record, the
start-up pre-tune would benchmark every GEMM key again at each start. So after the pre-tune, each
such autotuner's choices (key -> index of the chosen config) go to a small JSON file in Triton's
cache directory, through Triton's cache manager, and the next start puts them back in the
autotuner's cache before any launch. The file's name is a digest of the Triton version, the GPU,
the kernel's source (with the functions it calls) and the config list, so a change to any of them
starts afresh. The hooks still run on every launch: only the benchmark is skipped.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import logging
from collections.abc import Iterable

import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.cache import get_cache_manager

logger = logging.getLogger(__name__)

RECORD_FILE = "sits-autotune-choices.json"


def unrecorded_by_triton(tuners: Iterable[Autotuner]) -> list[Autotuner]:
    """The autotuners (of several configs) whose results Triton's disk cache skips: a config has a pre_hook."""
    return [t for t in tuners if len(t.configs) > 1 and any(config.pre_hook for config in t.configs)]


def record_digest(tuner: Autotuner, device_name: str) -> str:
    """What the choices are valid for: Triton's version, the GPU, the kernel's code and its configs."""
    fn = tuner.fn
    while not hasattr(fn, "cache_key") and hasattr(fn, "fn"):
        fn = fn.fn
    source = getattr(fn, "cache_key", None) or inspect.getsource(tuner.base_fn)
    parts = [triton.__version__, device_name, source, *map(str, tuner.configs)]
    return hashlib.sha256("-".join(parts).encode("utf-8")).hexdigest()


def save_choices(tuners: Iterable[Autotuner], device_name: str) -> int:
    """Write each autotuner's choices (those Triton skips); returns the keys written."""
    written = 0
    for tuner in unrecorded_by_triton(tuners):
        index = {id(config): position for position, config in enumerate(tuner.configs)}
        entries = sorted([repr(key), index[id(config)]] for key, config in tuner.cache.items() if id(config) in index)
        if entries:
            get_cache_manager(record_digest(tuner, device_name)).put(json.dumps(entries), RECORD_FILE, binary=False)
            written += len(entries)
    return written


def load_choices(tuners: Iterable[Autotuner], device_name: str) -> int:
    """Put the recorded choices back into the autotuners' caches; returns the keys restored.

    A record that cannot be read (damaged, or from another layout) is skipped with a debug line:
    its keys are simply tuned again.
    """
    restored = 0
    for tuner in unrecorded_by_triton(tuners):
        path = get_cache_manager(record_digest(tuner, device_name)).get_file(RECORD_FILE)
        if not path:
            continue
        try:
            with open(path, encoding="utf-8") as file:
                entries = [(ast.literal_eval(key), tuner.configs[position]) for key, position in json.load(file)]
        except (OSError, ValueError, SyntaxError, TypeError, IndexError) as error:
            logger.debug("autotune record %s unreadable (%s): tuning again", path, error)
            continue
        for key, config in entries:
            tuner.cache.setdefault(key, config)
        restored += len(entries)
    return restored
