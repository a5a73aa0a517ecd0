"""Measured per-GPU tables shipped beside the kernels (fp8_accum_table.json, small_m_gemm_table.json).

Each table names the GPU it was measured on ("device": torch.cuda.get_device_name(), "" for anywhere);
speeds measured on one chip say nothing of another, so a table read for another GPU gives the empty
table (the default rule of its kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar


class _DeviceTable(Protocol):
    device: str


T = TypeVar("T", bound=_DeviceTable)


def load_device_table(path: Path | str | None, default_path: Path, device_name: str | None,
                      parse: Callable[[str], T], empty: Callable[[], T]) -> T:
    """The table at `path` (default_path when None), parsed; `empty()` when there is no file, or when it
    was measured on another GPU than `device_name` (when both name one).

    Raises:
        ValueError: the file exists but `parse` rejects it.
    """
    path = Path(path) if path is not None else default_path
    if not path.is_file():
        return empty()
    table = parse(path.read_text())
    if device_name is not None and table.device and table.device != device_name:
        return empty()
    return table
