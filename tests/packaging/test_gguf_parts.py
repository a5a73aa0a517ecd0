"""benchmarks/gguf_parts.sh: the embedded GGUF in two parts that each fit one GPU call, joined back bit for bit.

The GPU machine's calls carry at most 64 MiB and the model is 98 MB: the script splits it here, keeps the first
part on the machine between two calls, joins and checks the SHA-256 there. This runs all three steps with
temporary folders standing in for the repository's ignored `.gl/` and the machine's /root/gguf.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from sits.runtime.models.embedded import embedded_gguf_path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_parts.sh"
CALL_LIMIT = 64 * 1024 * 1024


def run(step: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), step], capture_output=True, text=True, env=env, timeout=120,
                          check=False)


def test_the_parts_fit_a_call_and_join_into_the_model(tmp_path):
    parts, machine = tmp_path / "parts", tmp_path / "machine"
    env = {**os.environ, "PARTS_DIR": str(parts), "GGUF_DIR": str(machine)}
    assert run("split", env).returncode == 0
    sizes = [(parts / name).stat().st_size for name in ("gguf.part1", "gguf.part2")]
    assert all(0 < size < CALL_LIMIT for size in sizes)
    assert sum(sizes) == embedded_gguf_path().stat().st_size

    early = run("join", env)  # before stash: a clear error, no file
    assert early.returncode == 1 and "run stash in a call before" in early.stderr
    assert run("stash", env).returncode == 0
    joined = run("join", env)
    assert joined.returncode == 0, joined.stderr
    path = Path(joined.stdout.strip())
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(embedded_gguf_path().read_bytes()).digest()

    (parts / "gguf.part2").write_bytes(b"damaged")
    damaged = run("join", env)
    assert damaged.returncode == 1 and "SHA-256 differs" in damaged.stderr
    assert run("bogus", env).returncode == 2
