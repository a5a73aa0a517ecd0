"""The `sits` command: subcommands, one-line errors with exit code 2, and a one-shot answer."""

from __future__ import annotations

import importlib.metadata
import socket
import subprocess
import sys

import pytest

from sits.runtime import cli


def test_console_script_points_at_the_cli():
    (entry,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "sits"]
    assert entry.value == "sits.runtime.cli:main"


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "serve" in out and "generate" in out


def test_subcommands_come_from_the_registry():
    parser = cli.build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert set(cli.COMMANDS) <= set(choices)


@pytest.mark.parametrize("argv", [
    ["serve", "--block-size", "3"],
    ["serve", "--track", "blue"],
    ["serve", "--port", "70000"],
    ["serve", "--max-num-seqs", "0"],
    ["serve", "--kv-cache-gb", "-1"],
    ["serve", "--drain-timeout", "-5"],
    ["serve", "--dtype", "float8"],
    ["serve", "--bogus-flag"],
    ["serve", "--model", "/no/such/model.gguf", "--port", "0"],
    ["generate"],
    ["generate", "hi", "--max-model-len", "0"],
    ["nonsense"],
], ids=lambda argv: "-".join(argv)[:40])
def test_bad_flags_exit_2_with_one_line_on_stderr(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:  # argparse's own errors
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("sits") and "error:" in lines[0]


def test_a_taken_port_is_a_one_line_error_before_loading_the_model(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = cli.main(["serve", "--port", str(busy.getsockname()[1])])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sits serve: error: cannot listen on 127.0.0.1:") and "\n" not in err


def test_serve_process_with_a_bad_flag_exits_2():
    result = subprocess.run([sys.executable, "-m", "sits.runtime", "serve", "--block-size", "7"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "sits serve: error: --block-size must be a power of two up to 256, got 7"


def test_generate_streams_an_answer_to_stdout(smollm2_checkpoint_dir):
    result = subprocess.run(
        [sys.executable, "-m", "sits.runtime", "generate", "What is the capital of France?", "--max-tokens", "12",
         "--temperature", "0", "--device", "cpu", "--num-blocks", "64", "--max-model-len", "1024"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert result.stdout.endswith("\n") and len(result.stdout.splitlines()) <= 3
