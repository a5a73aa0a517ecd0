"""Merge a partial small-M table over a full one: `python benchmarks/merge_small_m_table.py BASE NEW OUT [OPS]`.

Entries of NEW (e.g. a `bench_gemm_small_m.py --proj o,down` run) replace BASE's at the same (op, N, K, M
bucket); BASE's device name is kept. OPS (comma-separated, e.g. norm_linear,norm_silu_mul) takes only those
ops from NEW, so a run without per-config timing (--no-configs) does not drop BASE's pinned configs. Used to
profile a re-measured subset beside the committed table (`gpu_profile_run.sh` steps prof1-gemv / prof32-gemv
with SMALL_M_TABLE=OUT).
"""

from __future__ import annotations

import sys
from pathlib import Path

from sits.kernels.small_m_table import OPS, SmallMTable, parse_small_m_table


def main(base_path: str, new_path: str, out_path: str, ops: str = ",".join(OPS)) -> None:
    wanted = set(ops.split(","))
    if not wanted <= set(OPS):
        sys.exit(f"unknown ops {sorted(wanted - set(OPS))}: choose from {', '.join(OPS)}")
    base = parse_small_m_table(Path(base_path).read_text())
    new = parse_small_m_table(Path(new_path).read_text())
    taken = {key: entry for key, entry in new.entries.items() if entry.op in wanted}
    merged = SmallMTable(base.device or new.device, {**base.entries, **taken})
    Path(out_path).write_text(merged.to_json())
    print(f"{out_path}: {len(merged.entries)} entries ({len(taken)} from {new_path}); {merged.describe()}")


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    main(*sys.argv[1:])
