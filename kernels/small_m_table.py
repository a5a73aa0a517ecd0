"""Where the small-M direct GEMM (sits.kernels.gemm_small_m) beats cuBLAS: a measured table per GPU.

Written by benchmarks/bench_gemm_small_m.py on the GPU, read by the engine (Triton-free: the engine
reads it before any kernel is imported). One entry per (op, N, K, M bucket):

* op "linear": small_m_gemm(x, w) and small_m_gemm_splitk(x, w, counters) (sits.kernels.gemm_small_m_splitk:
  K split over programs, reduced in the same launch) against torch.nn.functional.linear, w [N, K];
* op "silu_mul": small_m_gemm_silu_mul(x, w) against F.linear then sits.kernels.silu_mul.silu_mul,
  w [N, K] = [2I, K] (the MLP's gate_up weight; N is its row count, 2I);
* op "norm_linear": the decoder norm fused into the GEMM (sits.kernels.gemm_small_m_norm.small_m_norm_gemm,
  one launch) against the unfused path, sits.kernels.rmsnorm.rms_norm then the projection: "direct" is
  the fused launch, "cublas" the unfused path (us: "cublas" rms_norm + F.linear, "norm_direct" rms_norm +
  small_m_gemm); w [N, K] (qkv_proj's), M buckets up to NORM_MAX_M;
* op "norm_silu_mul": the same with the gate_up GEMM and SiLU·mul (small_m_norm_gemm_silu_mul against
  rms_norm + F.linear + silu_mul, and rms_norm + small_m_gemm_silu_mul), w [2I, K].

Each entry holds every side's microseconds per call and the winner, "direct" where the direct kernel
took at most 1 / MIN_SPEEDUP of cuBLAS's time, else "cublas" (for the norm ops: of the faster unfused
path's time); for "linear", "splitk" where the split-K kernel was the faster Triton side and beat cuBLAS so.
Where the bench timed every config in CUDA graphs, a Triton winner also pins the fastest one ("config": its
launch parameters), which the engine launches instead of autotuning at start-up (the autotuner's pick, timed
without graphs, was up to 1.18x slower than the best config on the H200). M buckets are powers of two up to 64
(the bench measures each); a call takes its own bucket's entry, and a shape or bucket with no entry
runs cuBLAS.

    {"version": 1, "device": "NVIDIA H200", "entries": [
      {"op": "linear", "n": 4096, "k": 4096, "m_bucket": 1, "winner": "direct",
       "us": {"direct": 9.8, "cublas": 10.9}}, ...]}

A table applies on a GPU of the same name only (an empty "device": anywhere). The norm ops joined the
format without changing it (version 1 still): a table without them reads as before, and a table with
them needs a build that knows them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from sits.kernels.device_tables import load_device_table

__all__ = ["CONFIG_KEYS", "DEFAULT_TABLE_PATH", "MAX_M", "MIN_SPEEDUP", "NORM_MAX_M", "NORM_OPS", "OPS",
           "SPLITK_CONFIG_KEYS", "TABLE_VERSION", "TIMED_SIDES", "TRITON_WINNERS", "WINNERS", "SmallMEntry",
           "SmallMTable", "choose_winner", "load_small_m_table", "m_bucket", "parse_small_m_table"]

NORM_OPS = ("norm_linear", "norm_silu_mul")  # the decoder norm fused into the GEMM's prologue
OPS = ("linear", "silu_mul", *NORM_OPS)
WINNERS = ("direct", "splitk", "cublas")  # "splitk": op "linear" only
TRITON_WINNERS = ("direct", "splitk")
TIMED_SIDES = (*WINNERS, "norm_direct")  # the keys of an entry's "us" ("norm_direct": norm ops only)
MAX_M = 64  # the direct kernel's largest batch (gemm_small_m.MAX_M)
NORM_MAX_M = 8  # the fused norm's largest batch (gemm_small_m_norm.NORM_MAX_M)
MIN_SPEEDUP = 1.02  # the direct kernel replaces cuBLAS only where it is measurably faster
TABLE_VERSION = 1
DEFAULT_TABLE_PATH = Path(__file__).with_name("small_m_gemm_table.json")


def m_bucket(m: int) -> int:
    """A batch's table key: M rounded up to a power of two (M >= 1)."""
    return 1 << max(int(m) - 1, 0).bit_length()


def choose_winner(direct_us: float | None, cublas_us: float | None, splitk_us: float | None = None) -> str:
    """The faster measured Triton side ("direct", or "splitk" where given and faster) where it took at most
    1 / MIN_SPEEDUP of cuBLAS's time, else "cublas"."""
    sides = {side: us for side, us in (("direct", direct_us), ("splitk", splitk_us)) if us is not None and us > 0}
    if not sides:
        return "cublas"
    side = min(sides, key=sides.__getitem__)
    if cublas_us is None or not cublas_us > 0:
        return side
    return side if sides[side] * MIN_SPEEDUP <= cublas_us else "cublas"


CONFIG_KEYS = ("BLOCK_N", "BLOCK_K", "SWAP_AB", "num_warps", "num_stages")  # a pinned config's keys
SPLITK_CONFIG_KEYS = (*CONFIG_KEYS, "SPLIT_K")  # the split-K kernel's


@dataclass(frozen=True)
class SmallMEntry:
    """One measured shape: op, weight [n, k], the batch's M bucket, the winner and each side's µs.

    config: the winning Triton kernel's launch config, where the bench timed each config in CUDA graphs and
    pinned the fastest (keys CONFIG_KEYS, plus SPLIT_K for "splitk"); None: the kernel autotunes at start-up.
    """

    op: str
    n: int
    k: int
    m_bucket: int
    winner: str
    us: dict[str, float] = field(default_factory=dict)
    config: dict[str, int] | None = None

    def to_dict(self) -> dict:
        row = {"op": self.op, "n": self.n, "k": self.k, "m_bucket": self.m_bucket, "winner": self.winner,
               "us": self.us}
        return row | ({"config": self.config} if self.config is not None else {})


@dataclass(frozen=True)
class SmallMTable:
    """The winner of each measured shape (cuBLAS elsewhere).

    Attributes:
        device: the GPU the figures were measured on ("": applies anywhere).
        entries: (op, n, k, m_bucket) -> SmallMEntry.
    """

    device: str = ""
    entries: dict[tuple[str, int, int, int], SmallMEntry] = field(default_factory=dict)

    def direct_buckets(self, op: str, n: int, k: int) -> frozenset[int]:
        """The M buckets at which `op` on an [n, k] weight runs a Triton kernel (the direct one, or for "linear"
        the split-K one: `splitk_buckets`)."""
        return frozenset(b for (o, bn, bk, b), e in self.entries.items()
                         if (o, bn, bk) == (op, n, k) and e.winner in TRITON_WINNERS)

    def pinned_configs(self, op: str, n: int, k: int) -> dict[int, dict[str, int]]:
        """M bucket -> the pinned launch config of `op` on an [n, k] weight, where its Triton winner has one."""
        return {b: dict(e.config) for (o, bn, bk, b), e in self.entries.items()
                if (o, bn, bk) == (op, n, k) and e.winner in TRITON_WINNERS and e.config is not None}

    def splitk_buckets(self, n: int, k: int) -> frozenset[int]:
        """The M buckets at which "linear" on an [n, k] weight runs the split-K kernel."""
        return frozenset(b for (o, bn, bk, b), e in self.entries.items()
                         if (o, bn, bk) == ("linear", n, k) and e.winner == "splitk")

    def describe(self) -> str:
        """E.g. "measured table of NVIDIA H200: direct at 12 of 35 shapes"."""
        if not self.entries:
            return "cuBLAS everywhere (no measured entry)"
        direct = sum(e.winner == "direct" for e in self.entries.values())
        splitk = sum(e.winner == "splitk" for e in self.entries.values())
        return (f"measured table of {self.device or 'an unnamed GPU'}: direct at {direct}"
                f"{f', split-K at {splitk}' if splitk else ''} of {len(self.entries)} shapes")

    def to_json(self) -> str:
        """The table's file: version and device, then one entry per line, by (op, N, K, M bucket)."""
        rows = [json.dumps(self.entries[key].to_dict()) for key in sorted(self.entries)]
        head = json.dumps({"version": TABLE_VERSION, "device": self.device})[:-1]
        return head + ', "entries": [' + ("\n" + ",\n".join(rows) + "\n" if rows else "") + "]}\n"


def _positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _entry(row: object) -> SmallMEntry:
    if not isinstance(row, dict):
        raise ValueError(f"bad small-M GEMM table entry {row!r}: not an object")
    op, winner, us = row.get("op"), row.get("winner"), row.get("us", {})
    if op not in OPS:
        raise ValueError(f"bad small-M GEMM table entry {row!r}: op must be one of {', '.join(OPS)}")
    if winner not in WINNERS:
        raise ValueError(f"bad small-M GEMM table entry {row!r}: winner must be one of {', '.join(WINNERS)}")
    n, k, bucket = (row.get(name) for name in ("n", "k", "m_bucket"))
    if not (_positive_int(n) and _positive_int(k) and _positive_int(bucket)) or bucket != m_bucket(bucket) \
            or bucket > MAX_M:
        raise ValueError(f"bad small-M GEMM table entry {row!r}: n and k must be positive, m_bucket a power of "
                         f"two up to {MAX_M}")
    if winner == "splitk" and op != "linear":
        raise ValueError(f"bad small-M GEMM table entry {row!r}: only op linear has a split-K kernel")
    if op in NORM_OPS and bucket > NORM_MAX_M:
        raise ValueError(f"bad small-M GEMM table entry {row!r}: {op} takes M buckets up to {NORM_MAX_M}")
    if op in ("silu_mul", "norm_silu_mul") and n % 2:
        raise ValueError(f"bad small-M GEMM table entry {row!r}: a silu_mul weight has an even row count")
    if not isinstance(us, dict) or any(s not in TIMED_SIDES or not isinstance(v, (int, float)) for s, v in us.items()):
        raise ValueError(f"bad small-M GEMM table entry {row!r}: 'us' must map {TIMED_SIDES} to numbers")
    return SmallMEntry(op, n, k, bucket, winner, {s: float(v) for s, v in us.items()}, _config(row, winner))


def _config(row: dict, winner: str) -> dict[str, int] | None:
    """An entry's pinned config, checked: the winner's keys (SPLIT_K for "splitk"), positive ints (SWAP_AB 0 / 1)."""
    config = row.get("config")
    if config is None:
        return None
    keys = SPLITK_CONFIG_KEYS if winner == "splitk" else CONFIG_KEYS
    if winner not in TRITON_WINNERS or not isinstance(config, dict) or set(config) != set(keys) or not all(
            isinstance(v, int) and (v in (0, 1) if key == "SWAP_AB" else v > 0) for key, v in config.items()):
        raise ValueError(f"bad small-M GEMM table entry {row!r}: 'config' pins a Triton winner's launch with "
                         f"exactly {', '.join(keys)} (positive ints; SWAP_AB 0 or 1)")
    return {key: int(config[key]) for key in keys}


def parse_small_m_table(text: str) -> SmallMTable:
    """A SmallMTable from its JSON; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
        rows, device, version = data["entries"], str(data.get("device", "")), data.get("version")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"not a small-M GEMM table ({error})") from None
    if version != TABLE_VERSION:
        raise ValueError(f"small-M GEMM table version {version!r}: this build reads version {TABLE_VERSION}; "
                         "measure it again with benchmarks/bench_gemm_small_m.py")
    if not isinstance(rows, list):
        raise ValueError("not a small-M GEMM table ('entries' must be a list)")
    entries = [_entry(row) for row in rows]
    return SmallMTable(device, {(e.op, e.n, e.k, e.m_bucket): e for e in entries})


def load_small_m_table(path: Path | str | None = None, device_name: str | None = None) -> SmallMTable:
    """The table at `path` (default: DEFAULT_TABLE_PATH); an empty table (cuBLAS everywhere) when there is
    no file, or when it was measured on another GPU than `device_name` (when both name one).

    Raises:
        ValueError: the file exists but is not a valid table.
    """
    return load_device_table(path, DEFAULT_TABLE_PATH, device_name, parse_small_m_table, SmallMTable)
