"""Precise or fast fp8 accumulation, per GEMM shape, from measured error and speed.

Hopper's fp8 tensor cores add products in reduced precision (about 14 bits of mantissa). The
precise mode of `fp8_gemm` promotes the sums to float32 every K tile of 128 (what torch._scaled_mm
does by default); the fast mode keeps the reduced-precision sums over the whole K, which is faster
where the GEMM is compute-bound and less exact the longer K is.

A table (JSON, written by benchmarks/bench_fp8_accum.py on the GPU) holds one entry per (M bucket,
N, K): both modes' relative error against a float32 product and their times, and the mode chosen.
`choose_fast` is the rule that picks it: fast only where it is measurably faster (>= MIN_SPEEDUP)
and its error stays within MAX_FAST_ERROR (errors of float32 outputs, so the accumulation's own:
at most the rounding of a bf16 output, 2^-9). An M between measured buckets takes the entry of the
largest measured bucket below it for the same (N, K) (the smallest when none is below: GEMMs turn
compute-bound as M grows, so the choice is a step in M). (N, K) pairs the table does not hold get
the default rule: precise everywhere, what `fp8_gemm` did before the table. Decode shapes
(M <= 256) read the weight once per step and are bandwidth-bound, so fast sums save little there,
while DeepSeek-V3's report measured up to ~2 % relative error at K = 4,096 without promotion: a
measurement has to justify them.

    {"device": "NVIDIA H200", "entries": [{"m_bucket": 8192, "n": 28672, "k": 4096,
      "fast_accum": true, "precise_error": 0.0021, "fast_error": 0.0034,
      "precise_ms": 1.91, "fast_ms": 1.62, "scaled_mm_ms": 1.70}, ...]}
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_TABLE_PATH", "AccumEntry", "AccumTable", "choose_fast", "fast_at", "load_accum_table", "m_bucket",
           "parse_accum_table"]

MIN_SPEEDUP = 1.05
MAX_FAST_ERROR = 2e-3  # relative Frobenius error of a float32 output against float32 sums; bf16 rounds by 2^-9
M_BUCKET_CAP = 1 << 16
DEFAULT_TABLE_PATH = Path(__file__).with_name("fp8_accum_table.json")


def m_bucket(m: int) -> int:
    """The table's row key: M rounded up to a power of two, at most M_BUCKET_CAP (the fp8 GEMM's own
    autotune bucket, launch_utils.length_bucket; computed here so the engine needs no Triton to read it)."""
    return min(1 << max(int(m) - 1, 0).bit_length(), M_BUCKET_CAP)


def choose_fast(precise_error: float, fast_error: float, precise_ms: float, fast_ms: float) -> bool:
    """The rule: fast accumulation where it is >= MIN_SPEEDUP faster and its error <= MAX_FAST_ERROR."""
    return fast_ms * MIN_SPEEDUP <= precise_ms and fast_error <= MAX_FAST_ERROR


@dataclass(frozen=True)
class AccumEntry:
    """One measured shape.

    Attributes:
        m_bucket, n, k: the GEMM's shape key (M rounded up to a power of two).
        fast_accum: the mode chosen (choose_fast of the figures below).
        precise_error, fast_error: relative error of each mode's float32 output against float32 sums
            of the same e4m3 operands (the accumulation's error alone).
        precise_ms, fast_ms: each mode's time, ms.
        scaled_mm_ms: torch._scaled_mm's time on the same operands (precise), ms; for the record.
    """

    m_bucket: int
    n: int
    k: int
    fast_accum: bool
    precise_error: float
    fast_error: float
    precise_ms: float
    fast_ms: float
    scaled_mm_ms: float | None = None


@dataclass(frozen=True)
class AccumTable:
    """The accumulation mode of each measured shape; the default rule (precise) elsewhere.

    Attributes:
        device: the GPU the figures were measured on ("" for the default rule alone).
        entries: (m_bucket, n, k) -> AccumEntry.
    """

    device: str = ""
    entries: dict[tuple[int, int, int], AccumEntry] = field(default_factory=dict)

    def steps(self, n: int, k: int) -> tuple[tuple[int, bool], ...]:
        """The (m_bucket, fast_accum) entries of an [N, K] weight, ascending in M (empty: default rule)."""
        return tuple(sorted((b, e.fast_accum) for (b, bn, bk), e in self.entries.items() if (bn, bk) == (n, k)))

    def fast_accum(self, m: int, n: int, k: int) -> bool:
        """Whether an [m, k] x [n, k]^T fp8 GEMM runs with fast accumulation."""
        return fast_at(self.steps(n, k), m)

    def to_json(self) -> str:
        rows = [vars(e) for e in sorted(self.entries.values(), key=lambda e: (e.n, e.k, e.m_bucket))]
        return json.dumps({"device": self.device, "entries": rows}, indent=1)


def fast_at(steps: tuple[tuple[int, bool], ...], m: int) -> bool:
    """The mode for M rows from a weight's `AccumTable.steps`: the largest measured bucket <= M's
    bucket, else the smallest; precise (False) when nothing was measured."""
    if not steps:
        return False
    index = bisect.bisect_right(steps, (m_bucket(m), True)) - 1
    return steps[max(index, 0)][1]


def _entry(row: dict) -> AccumEntry:
    try:
        entry = AccumEntry(**row)
    except TypeError as error:
        raise ValueError(f"bad fp8 accumulation entry {row!r}: {error}") from None
    if entry.m_bucket != m_bucket(entry.m_bucket) or min(entry.n, entry.k) < 1:
        raise ValueError(f"bad fp8 accumulation entry {row!r}: m_bucket must be a power of two, n and k positive")
    return entry


def parse_accum_table(text: str) -> AccumTable:
    """An AccumTable from its JSON; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
        rows = data["entries"]
        device = str(data.get("device", ""))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not an fp8 accumulation table ({error})") from None
    entries = [_entry(row) for row in rows]
    return AccumTable(device, {(e.m_bucket, e.n, e.k): e for e in entries})


def load_accum_table(path: Path | str | None = None, device_name: str | None = None) -> AccumTable:
    """The table at `path` (default: DEFAULT_TABLE_PATH), or the default rule when there is none.

    A table measured on another GPU than `device_name` (when given) does not apply: its speeds are
    another chip's, so the default rule is returned.
    Raises:
        ValueError: the file exists but is not a valid table.
    """
    path = Path(path) if path is not None else DEFAULT_TABLE_PATH
    if not path.is_file():
        return AccumTable()
    table = parse_accum_table(path.read_text())
    if device_name is not None and table.device and table.device != device_name:
        return AccumTable()
    return table
