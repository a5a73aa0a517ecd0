"""What the CPU benchmarks print around their tables: the machine's name, and the closing report
(title, table, optional JSON of the rows)."""

from __future__ import annotations

import dataclasses
import json
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def print_report(title: str, print_table: Callable[[Any], None], rows: Sequence[Any], json_path: str | None) -> None:
    """Print a blank line, `title` and `print_table(rows)`; with `json_path`, also write the rows
    (dataclasses) there as a JSON list."""
    print(f"\n{title}")
    print_table(rows)
    if json_path:
        Path(json_path).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
