"""Merge a partial small-M table over a full one: `python benchmarks/merge_small_m_table.py BASE NEW OUT`.

Entries of NEW (e.g. a `bench_gemm_small_m.py --proj o,down` run) replace BASE's at the same (op, N, K, M
bucket); BASE's device name is kept. Used to profile a re-measured subset beside the committed table
(`gpu_profile_run.sh` steps prof1-gemv / prof32-gemv with SMALL_M_TABLE=OUT).
"""

from __future__ import annotations

import sys
from pathlib import Path

from sits.kernels.small_m_table import SmallMTable, parse_small_m_table


def main(base_path: str, new_path: str, out_path: str) -> None:
    base = parse_small_m_table(Path(base_path).read_text())
    new = parse_small_m_table(Path(new_path).read_text())
    merged = SmallMTable(base.device or new.device, {**base.entries, **new.entries})
    Path(out_path).write_text(merged.to_json())
    print(f"{out_path}: {len(merged.entries)} entries ({len(new.entries)} from {new_path}); {merged.describe()}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
