"""How long `sits serve` is silent after it starts: wall and CPU seconds to its first log line.

Peer, in the same run: a Python process that imports torch and fastapi and then prints a line, the
least a server that imports its stack before saying anything pays on this machine. Each command
runs --repeat times; the table gives the median, and the ratio sits serve / peer.

    python benchmarks/bench_first_line.py [--repeat 3] [-- extra sits serve flags]

Default flags: `--load-format dummy --config tiny --port 0` (no model file is read before the line).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PEER = "import torch, fastapi, sys; print('ready', file=sys.stderr, flush=True)"


def first_line(cmd: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the process, the line) when `cmd` writes its first stderr line."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        wall = time.monotonic() - start
        with open(f"/proc/{proc.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    finally:
        proc.kill()
        proc.wait(30)
        proc.stderr.close()
    return wall, cpu, line.strip()


def measure(cmd: list[str], repeat: int) -> tuple[float, float, str]:
    runs = [first_line(cmd) for _ in range(repeat)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), runs[-1][2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("flags", nargs="*", default=["--load-format", "dummy", "--config", "tiny", "--port", "0"])
    args = parser.parse_args(argv)
    sits = measure([sys.executable, "-m", "sits.runtime", "serve", *args.flags], args.repeat)
    peer = measure([sys.executable, "-c", PEER], args.repeat)
    print(f"load average {os.getloadavg()[0]:.1f}; first line of sits serve: {sits[2][:90]}")
    print("| command | wall s to the first line | CPU s |")
    print("|---|---|---|")
    print(f"| sits serve {' '.join(args.flags)} | {sits[0]:.2f} | {sits[1]:.2f} |")
    print(f"| peer: python -c 'import torch, fastapi' | {peer[0]:.2f} | {peer[1]:.2f} |")
    print(f"\nsits serve / peer: {sits[0] / peer[0]:.2f}x wall, {sits[1] / max(peer[1], 1e-9):.2f}x CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
