"""On / off switches read from the environment (benchmarks measuring a path both ways)."""

from __future__ import annotations

import os


def env_switch(name: str) -> bool | None:
    """An on / off environment variable: None when unset or empty, False for 0 / off / false / no, else True."""
    value = os.environ.get(name, "").strip().lower()
    return None if not value else value not in ("0", "off", "false", "no")
