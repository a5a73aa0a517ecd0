"""Progress of a long model-loading step (tensors converted from a GGUF file, tensors loaded).

On a terminal a tqdm bar; anywhere else (a log file, a pipe, a pod's log) a plain INFO line at each quarter,
so no carriage returns and half-drawn bars reach a log. The caller logs the step's end itself.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

__all__ = ["LoadProgress"]

logger = logging.getLogger(__name__)

QUARTERS = (25, 50, 75)  # percent done at which a plain progress line is logged (the end is the caller's)


class LoadProgress:
    """Counts the items of one step and shows how far it is.

    Use as a context manager: `with LoadProgress(272, "Loading SmolLM2", "tensor") as bar: ... bar.update()`.

    Args:
        total: items the step will count (tensors); 0 shows nothing.
        desc: what the step does, shown first ("Converting model.gguf").
        unit: the item's name, singular ("tensor").
        enabled: False shows nothing at all (tests, benchmarks, callers with their own output).
        stream: where a bar would be drawn; default `sys.stderr`. A bar only when it is a TTY.
    """

    def __init__(self, total: int, desc: str, unit: str, *, enabled: bool = True, stream: TextIO | None = None):
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        stream = stream if stream is not None else sys.stderr
        shown = enabled and total > 0
        self.on_terminal = shown and _is_terminal(stream)
        self._plain = shown and not self.on_terminal
        self._next_quarter = 0
        self._bar = tqdm(total=total, desc=desc, unit=unit, file=stream, leave=False) if self.on_terminal else None

    def update(self, count: int = 1) -> None:
        """Count `count` more items done."""
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self._plain:
            while self._next_quarter < len(QUARTERS) and self.done * 100 >= QUARTERS[self._next_quarter] * self.total:
                logger.info("%s: %d/%d %ss (%d%%)", self.desc, self.done, self.total, self.unit,
                            QUARTERS[self._next_quarter])
                self._next_quarter += 1

    def close(self) -> None:
        """Remove the bar (a terminal keeps the log lines that follow clean)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> LoadProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    """Whether the stream is an interactive terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
