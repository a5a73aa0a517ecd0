"""`sits serve` says what it does before it imports anything heavy.

Its first log line comes once the flags are checked, before torch, the web framework or the
grammar compiler are imported: `python -X importtime` lists every import on stderr as it happens,
so the lines before the first log line show what the start paid for. (How long it takes on a given
machine is measured, not asserted: benchmarks/RESULTS.md.) A bad flag is still one line and exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "fastapi", "uvicorn", "xgrammar", "transformers", "httpx", "jinja2")


def imports_before_first_line(*flags: str) -> tuple[set[str], str]:
    """Top-level packages imported before `sits serve`'s first log line, and that line."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "sits.runtime", "serve", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    imported: set[str] = set()
    try:
        for line in proc.stderr:
            if line.startswith("import time:"):
                name = line.rsplit("|", 1)[1].strip()
                imported.add(name.split(".")[0])
            elif line.strip():
                return imported, line.strip()
        pytest.fail("sits serve exited before logging anything")
    finally:
        proc.kill()
        proc.wait(30)
        proc.stderr.close()
    raise AssertionError("unreachable")


def test_the_first_line_comes_before_any_heavy_import():
    imported, first = imports_before_first_line("--load-format", "dummy", "--config", "tiny", "--port", "0")
    assert "sits serve: loading tiny, then serving on 127.0.0.1:" in first
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))


def test_a_bad_flag_is_still_one_line_and_exit_2():
    result = subprocess.run([sys.executable, "-m", "sits.runtime", "serve", "--max-num-seqs", "0"],
                            capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2
    assert lines == ["sits serve: error: --max-num-seqs must be positive, got 0"]
