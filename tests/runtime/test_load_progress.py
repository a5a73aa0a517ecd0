"""Load progress: a bar on a terminal, plain log lines elsewhere (no carriage returns in a log file)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ModelConfig
from sits.runtime.models.loading import load_model
from sits.runtime.models.progress import LoadProgress

PROGRESS_LOGGER = "sits.runtime.models.progress"


class Terminal(io.StringIO):
    """A stream that says it is a TTY, as an interactive stderr does."""

    def isatty(self) -> bool:
        return True


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PROGRESS_LOGGER]


def test_off_a_terminal_it_logs_a_line_at_each_quarter_and_draws_nothing(caplog):
    log_file = io.StringIO()
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    with LoadProgress(10, "Converting model.gguf", "tensor", stream=log_file) as bar:
        for _ in range(10):
            bar.update()
    assert progress_lines(caplog) == ["Converting model.gguf: 3/10 tensors (25%)",
                                      "Converting model.gguf: 5/10 tensors (50%)",
                                      "Converting model.gguf: 8/10 tensors (75%)"]
    assert log_file.getvalue() == ""
    assert not bar.on_terminal


def test_a_jump_past_several_quarters_logs_each_once(caplog):
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    with LoadProgress(4, "Loading tiny", "tensor", stream=io.StringIO()) as bar:
        bar.update(4)
        bar.update(0)
    assert [line.rsplit("(", 1)[1] for line in progress_lines(caplog)] == ["25%)", "50%)", "75%)"]


def test_on_a_terminal_it_draws_a_bar_and_logs_nothing(caplog):
    terminal = Terminal()
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    with LoadProgress(8, "Loading tiny", "tensor", stream=terminal) as bar:
        for _ in range(8):
            bar.update()
    assert bar.on_terminal
    assert "Loading tiny" in terminal.getvalue() and "\r" in terminal.getvalue()
    assert progress_lines(caplog) == []


@pytest.mark.parametrize("enabled, total", [(False, 8), (True, 0)])
def test_disabled_or_empty_shows_nothing(caplog, enabled, total):
    terminal = Terminal()
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    with LoadProgress(total, "Loading tiny", "tensor", enabled=enabled, stream=terminal) as bar:
        bar.update(8)
    assert terminal.getvalue() == "" and progress_lines(caplog) == []


def test_loading_a_model_with_stderr_in_a_file_writes_plain_lines(tiny_llama_dir, caplog, capfd):
    caplog.set_level(logging.INFO, logger=PROGRESS_LOGGER)
    load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"), TorchAttentionBackend(),
               progress=True)
    lines = progress_lines(caplog)
    assert len(lines) == 3 and all(line.startswith("Loading ") and " tensors (" in line for line in lines)
    assert "\r" not in capfd.readouterr().err


def test_sits_generate_shows_load_progress_on_a_terminal_and_keeps_stdout_clean(tiny_llama_dir):
    """stderr on a pseudo-terminal, stdout a pipe: the bar goes to the terminal, only the answer to stdout."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size: tqdm draws to it
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "sits.runtime", "generate", "Hello", "--model", str(tiny_llama_dir),
             "--device", "cpu", "--max-tokens", "2", "--max-model-len", "64", "--kv-cache-gb", "0.01"],
            stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL)
        os.close(follower)
        terminal = b""
        with contextlib.suppress(OSError):  # EIO once the child closed its end
            while chunk := os.read(leader, 4096):
                terminal += chunk
        stdout, _ = process.communicate(timeout=120)
    finally:
        os.close(leader)
    assert process.returncode == 0, terminal.decode(errors="replace")
    assert b"Loading " in terminal and b"tensor" in terminal
    assert b"Loading" not in stdout and stdout.strip()
