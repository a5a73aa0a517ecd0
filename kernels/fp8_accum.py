"""The fp8 GEMM's backend per shape (Triton or cuBLAS, precise or fast sums), from measured error and speed.

Hopper's fp8 tensor cores add products in reduced precision (about 14 bits of mantissa). Four
backends compute the same scaled e4m3 GEMM (`BACKENDS`):

* `triton`: sits.kernels.fp8_gemm, sums promoted to float32 every K tile of 128 (the default);
* `scaled_mm`: torch._scaled_mm with rowwise scales (a_scale [M, 1], w_scale [1, N], float32),
  the vendor kernel (cuBLASLt, or PyTorch's CUTLASS kernel where cuBLAS lacks rowwise scaling),
  promoted the same way;
* `triton_fast`, `scaled_mm_fast`: the same kernels keeping the reduced-precision sums over the
  whole K, faster where the GEMM is compute-bound and less exact the longer K is.

A table (JSON, written by benchmarks/bench_fp8_accum.py on the GPU) holds one entry per (M bucket,
N, K): each backend's time and relative error against float32 sums of the same e4m3 operands, and
the backend chosen by `choose_backend`: of the backends whose error is at most MAX_FAST_ERROR, the
first in BACKENDS order (precise before fast, Triton before cuBLAS) whose time is within
MIN_SPEEDUP of the fastest. So a backend replaces `triton` only where it is measurably faster, and
fast sums only where their error stays within the rounding of a bf16 output (2^-9). A call's M is
rounded up to its bucket (a power of two, as the Triton kernel's autotune key: 448 -> 512) and
takes the entry of the largest measured bucket at or below it for the same (N, K) (the smallest
when none is: GEMMs turn compute-bound as M grows, so the choice is a step in M). (N, K) pairs the
table does not hold get `triton`, what `fp8_gemm` did before the table.

    {"version": 2, "device": "NVIDIA H200", "entries": [{"m_bucket": 8192, "n": 28672, "k": 4096,
      "backend": "scaled_mm", "ms": {"triton": 1.91, "triton_fast": 1.62, "scaled_mm": 1.55, ...},
      "error": {"triton": 2.1e-07, "triton_fast": 0.0034, "scaled_mm": 2.0e-07, ...}}, ...]}

Version 1 tables (no "version"; rows with "fast_accum", "precise_ms", "fast_ms", ...: precise or
fast Triton only) still load, with their recorded choice.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from sits.kernels.device_tables import load_device_table

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "DEFAULT_TABLE_PATH", "SCALED_MM_BACKENDS", "TABLE_VERSION", "AccumEntry",
           "AccumTable", "backend_at", "choose_backend", "load_accum_table", "m_bucket", "parse_accum_table"]

BACKENDS = ("triton", "scaled_mm", "triton_fast", "scaled_mm_fast")  # the order of preference among near-ties
DEFAULT_BACKEND = "triton"
FAST_BACKENDS = frozenset({"triton_fast", "scaled_mm_fast"})
SCALED_MM_BACKENDS = frozenset({"scaled_mm", "scaled_mm_fast"})
TABLE_VERSION = 2
MIN_SPEEDUP = 1.05
MAX_FAST_ERROR = 2e-3  # relative Frobenius error of a float32 output against float32 sums; bf16 rounds by 2^-9
M_BUCKET_CAP = 1 << 16
DEFAULT_TABLE_PATH = Path(__file__).with_name("fp8_accum_table.json")


def m_bucket(m: int) -> int:
    """The table's row key: M rounded up to a power of two, at most M_BUCKET_CAP (the fp8 GEMM's own
    autotune bucket, launch_utils.length_bucket; computed here so the engine needs no Triton to read it)."""
    return min(1 << max(int(m) - 1, 0).bit_length(), M_BUCKET_CAP)


def _measured(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def choose_backend(ms: Mapping[str, float | None], error: Mapping[str, float | None]) -> str:
    """The rule: of the backends with a time and an error <= MAX_FAST_ERROR, the first in BACKENDS
    order whose time is within MIN_SPEEDUP of the fastest one's; DEFAULT_BACKEND when none qualifies.

    Args:
        ms: milliseconds per call by backend; missing or None: not measured (cannot be chosen).
        error: relative error by backend (float32 output against float32 sums).
    """
    eligible: dict[str, float] = {}
    for backend in BACKENDS:
        t, e = ms.get(backend), error.get(backend)
        if t is not None and e is not None and _measured(t) and _measured(e) and e <= MAX_FAST_ERROR:
            eligible[backend] = t
    if not eligible:
        return DEFAULT_BACKEND
    fastest = min(eligible.values())
    return next(b for b, t in eligible.items() if t <= fastest * MIN_SPEEDUP)


@dataclass(frozen=True)
class AccumEntry:
    """One measured shape.

    Attributes:
        m_bucket, n, k: the GEMM's shape key (M rounded up to a power of two).
        backend: the backend chosen (one of BACKENDS; choose_backend of the figures below when measured).
        ms: each measured backend's time, ms per call (bf16 output).
        error: each measured backend's relative error, float32 output against float32 sums of the
            same e4m3 operands (the accumulation's error alone).
    """

    m_bucket: int
    n: int
    k: int
    backend: str
    ms: dict[str, float] = field(default_factory=dict)
    error: dict[str, float] = field(default_factory=dict)

    @classmethod
    def measured(cls, m_bucket: int, n: int, k: int, ms: Mapping[str, float | None],
                 error: Mapping[str, float | None]) -> AccumEntry:
        """The entry of these figures, with the backend `choose_backend` picks (None figures dropped)."""
        keep = {b: float(v) for b, v in ms.items() if v is not None}
        errors = {b: float(v) for b, v in error.items() if v is not None}
        return cls(m_bucket, n, k, choose_backend(keep, errors), keep, errors)


@dataclass(frozen=True)
class AccumTable:
    """The backend of each measured shape; DEFAULT_BACKEND elsewhere.

    Attributes:
        device: the GPU the figures were measured on ("" for the default rule alone).
        entries: (m_bucket, n, k) -> AccumEntry.
    """

    device: str = ""
    entries: dict[tuple[int, int, int], AccumEntry] = field(default_factory=dict)

    def steps(self, n: int, k: int) -> tuple[tuple[int, str], ...]:
        """The (m_bucket, backend) entries of an [N, K] weight, ascending in M (empty: default rule)."""
        return tuple(sorted((b, e.backend) for (b, bn, bk), e in self.entries.items() if (bn, bk) == (n, k)))

    def backend(self, m: int, n: int, k: int) -> str:
        """The backend of an [m, k] x [n, k]^T fp8 GEMM."""
        return backend_at(self.steps(n, k), m)

    def backends_used(self) -> frozenset[str]:
        """The backends some entry chose."""
        return frozenset(e.backend for e in self.entries.values())

    def without(self, backends: frozenset[str] | set[str]) -> AccumTable:
        """This table where `backends` cannot run: their entries re-chosen among the other measured
        backends by the rule (DEFAULT_BACKEND when no figure remains)."""
        entries = {}
        for key, e in self.entries.items():
            if e.backend in backends:
                ms = {b: t for b, t in e.ms.items() if b not in backends}
                e = replace(e, backend=choose_backend(ms, e.error))
            entries[key] = e
        return AccumTable(self.device, entries)

    def describe(self) -> str:
        """How many shapes chose each backend, e.g. "measured table of NVIDIA H200: scaled_mm 22, triton 18"."""
        if not self.entries:
            return "triton everywhere (default rule)"
        counts: dict[str, int] = {}
        for e in self.entries.values():
            counts[e.backend] = counts.get(e.backend, 0) + 1
        chosen = ", ".join(f"{b} {counts[b]}" for b in BACKENDS if b in counts)
        return f"measured table of {self.device or 'an unnamed GPU'}: {chosen} of {len(self.entries)} shapes"

    def to_json(self) -> str:
        """The table's file: version and device, then one entry per line, by (N, K, M bucket)."""
        rows = [json.dumps({"m_bucket": e.m_bucket, "n": e.n, "k": e.k, "backend": e.backend, "ms": e.ms,
                            "error": e.error})
                for e in sorted(self.entries.values(), key=lambda e: (e.n, e.k, e.m_bucket))]
        head = json.dumps({"version": TABLE_VERSION, "device": self.device})[:-1]
        return head + ', "entries": [\n' + ",\n".join(rows) + "\n]}\n"


def backend_at(steps: tuple[tuple[int, str], ...], m: int) -> str:
    """The backend for M rows from a weight's `AccumTable.steps`: that of the largest measured bucket
    <= M's bucket, else of the smallest; DEFAULT_BACKEND when nothing was measured."""
    if not steps:
        return DEFAULT_BACKEND
    index = bisect.bisect_right(steps, m_bucket(m), key=lambda step: step[0]) - 1
    return steps[max(index, 0)][1]


def _figures(row: dict, key: str) -> dict[str, float]:
    value = row.get(key, {})
    if not isinstance(value, dict) or any(b not in BACKENDS or not isinstance(v, (int, float))
                                          for b, v in value.items()):
        raise ValueError(f"bad fp8 GEMM table entry {row!r}: {key!r} must map backends {BACKENDS} to numbers")
    return {b: float(v) for b, v in value.items()}


def _v1_row(row: dict) -> dict:
    """A version 1 row (precise or fast Triton) as a version 2 row; its recorded choice kept."""
    try:
        ms = {"triton": row["precise_ms"], "triton_fast": row["fast_ms"]}
        error = {"triton": row["precise_error"], "triton_fast": row["fast_error"]}
        fast = row["fast_accum"]
    except KeyError as missing:
        raise ValueError(f"bad fp8 GEMM table entry {row!r}: version 1 rows need {missing}") from None
    if row.get("scaled_mm_ms") is not None:  # timed only, no error measured: never chosen
        ms["scaled_mm"] = row["scaled_mm_ms"]
    return {"m_bucket": row.get("m_bucket"), "n": row.get("n"), "k": row.get("k"),
            "backend": "triton_fast" if fast else "triton", "ms": ms, "error": error}


def _entry(row: object, version: int) -> AccumEntry:
    if not isinstance(row, dict):
        raise ValueError(f"bad fp8 GEMM table entry {row!r}: not an object")
    if version == 1:
        row = _v1_row(row)
    shape = [row.get(name) for name in ("m_bucket", "n", "k")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape) or shape[0] != m_bucket(
            shape[0]):
        raise ValueError(f"bad fp8 GEMM table entry {row!r}: m_bucket must be a power of two, n and k positive")
    backend = row.get("backend")
    if backend not in BACKENDS:
        raise ValueError(f"bad fp8 GEMM table entry {row!r}: backend must be one of {', '.join(BACKENDS)}")
    return AccumEntry(shape[0], shape[1], shape[2], backend, _figures(row, "ms"), _figures(row, "error"))


def parse_accum_table(text: str) -> AccumTable:
    """An AccumTable from its JSON (version 1 or 2); ValueError naming what is wrong."""
    try:
        data = json.loads(text)
        rows = data["entries"]
        device = str(data.get("device", ""))
        version = data.get("version", 1)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not an fp8 GEMM table ({error})") from None
    if version not in (1, TABLE_VERSION):
        raise ValueError(f"fp8 GEMM table version {version!r}: this build reads versions 1 and {TABLE_VERSION}; "
                         "measure it again with benchmarks/bench_fp8_accum.py")
    if not isinstance(rows, list):
        raise ValueError("not an fp8 GEMM table ('entries' must be a list)")
    entries = [_entry(row, version) for row in rows]
    return AccumTable(device, {(e.m_bucket, e.n, e.k): e for e in entries})


def load_accum_table(path: Path | str | None = None, device_name: str | None = None) -> AccumTable:
    """The table at `path` (default: DEFAULT_TABLE_PATH), or the default rule when there is none.

    A table measured on another GPU than `device_name` (when given) does not apply: its speeds are
    another chip's, so the default rule is returned.
    Raises:
        ValueError: the file exists but is not a valid table.
    """
    return load_device_table(path, DEFAULT_TABLE_PATH, device_name, parse_accum_table, AccumTable)
