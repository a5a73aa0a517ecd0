"""Which measured kernel table an engine installs: the committed one, another file, or none (env override).

SITS_FP8_GEMM_TABLE (the fp8 GEMM backend per shape) and SITS_SMALL_M_GEMM (the bf16 small-M GEMM) work
alike: unset, the table committed beside the kernels applies where it was measured on this GPU; `off`, the
kernel's default rule (to measure what the table changes); a path, that table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sits.runtime.config import ConfigError

T = TypeVar("T")


def table_from_env(env: str, device_name: str, default_path: Path, load: Callable[..., T], empty: Callable[[], T],
                   writer: str) -> T:
    """The table `env` selects for the GPU `device_name`.

    Args:
        env: the variable's name.
        default_path: the committed table.
        load: `load(path, device_name=...)`, the table or the empty one for another GPU; ValueError if invalid.
        empty: the table of the default rule.
        writer: what writes such a table (named in the error).
    Raises:
        ConfigError: the path names no file, or the file is not a valid table.
    """
    source = os.environ.get(env, "").strip()
    if source.lower() == "off":
        return empty()
    path = Path(source) if source else default_path
    if source and not path.is_file():
        raise ConfigError(f"{env}={source}: no such file (give a table written by {writer}, or 'off')")
    try:
        return load(path, device_name=device_name)
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None
