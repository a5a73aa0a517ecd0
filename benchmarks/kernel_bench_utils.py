"""Timing and reporting helpers shared by the kernel benchmarks (benchmarks/bench_<op>.py).

Every figure is measured the same way for our kernel and its peer, in the same process:
a warm-up call (compilation, autotuning, cuDNN plans), then a CUDA graph holding several calls,
replayed several times and timed with CUDA events; the median per-call time is reported. Graphs
remove Python launch overhead for both sides alike (the runtime replays graphs for decode too).
Where a callable cannot be captured, it falls back to triton.testing.do_bench (median).

Inputs larger than L2 are used as they are; callables may rotate through several input sets
(see `rotating`) so small problems are not timed out of L2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Measurement:
    """One timed case: our kernel against its best peer, in one unit (TFLOP/s or GB/s)."""

    case: str
    unit: str
    ours: float
    peer: float
    peer_name: str
    ours_ms: float
    peer_ms: float
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.ours / self.peer if self.peer else float("nan")


def time_ms(fn: Callable[[], object], calls_per_graph: int = 10, replays: int = 15) -> float:
    """Median milliseconds per call of fn, captured in a CUDA graph (do_bench if capture fails)."""
    fn()  # compile / autotune / plan outside the graph
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls_per_graph):
                fn()
    except Exception:  # noqa: BLE001 - some peers cannot be captured; time them eagerly instead
        torch.cuda.synchronize()
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls_per_graph)
    return statistics.median(samples)


def rotating(fn: Callable[[int], object], count: int) -> Callable[[], object]:
    """A no-argument callable that calls fn(0), fn(1), ... fn(count - 1), fn(0), ... in turn.

    Inside a CUDA graph, consecutive captured calls then read different buffers.
    """
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % count
        return fn(i)

    return call


def best_peer(peers: dict[str, Callable[[], object]], work: float) -> tuple[str, float, dict[str, float]]:
    """Times every peer; returns (name of the fastest, its ms, all ms). Peers that fail are skipped."""
    times = {}
    for name, fn in peers.items():
        try:
            times[name] = time_ms(fn)
        except Exception as error:  # noqa: BLE001 - a peer back end missing on this machine
            print(f"  peer {name} unavailable: {type(error).__name__}: {str(error)[:160]}")
    if not times:
        raise RuntimeError("no peer could run")
    name = min(times, key=times.get)
    return name, times[name], times


def hbm_copy_gbps(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), the HBM ceiling.

    Timed eagerly: inside a CUDA graph the copy becomes a memcpy node, which ran at about two
    thirds of this speed on an H200.
    """
    import triton.testing

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median"))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def bandwidth_case(case: str, num_bytes: int, ours: Callable[[], object], peers: dict[str, Callable[[], object]],
                   copy_gbps: float) -> Measurement:
    """A memory-bound case: GB/s moved (num_bytes read + written per call) by ours and by its best
    peer, with ours as a share of the copy bandwidth (`extra["pct_of_copy_bw"]`)."""
    peer_name, peer_ms, _ = best_peer(peers, num_bytes)
    ours_ms = time_ms(ours)

    def gbps(ms: float) -> float:
        return num_bytes / (ms * 1e-3) / 1e9

    return Measurement(case, "GB/s", gbps(ours_ms), gbps(peer_ms), peer_name, ours_ms, peer_ms,
                       {"pct_of_copy_bw": round(100 * gbps(ours_ms) / copy_gbps, 1)})


def bandwidth_main(description: str, title: str, shapes: Sequence[tuple[int, int]],
                   run_shape: Callable[[int, int, float], list[Measurement]]) -> None:
    """The main of a memory-bound kernel's benchmark: the copy bandwidth, then `run_shape(rows,
    columns, copy_gbps)` for each shape (the first only with --quick), reported with each case's
    share of the copy bandwidth."""
    args = parse_args(description)
    copy_gbps = hbm_copy_gbps()
    rows = [m for r, c in (shapes[:1] if args.quick else shapes) for m in run_shape(r, c, copy_gbps)]
    notes = [f"HBM copy bandwidth in this run: {copy_gbps:,.0f} GB/s; SITS share of it per case: "
             + ", ".join(f"{r.case}: {r.extra['pct_of_copy_bw']}%" for r in rows)]  # fmt: skip
    report(title, rows, args.json, notes)


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", help="also write the measurements to this JSON file")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    return parser.parse_args()


def report(title: str, rows: Sequence[Measurement], json_path: str | None = None, notes: Sequence[str] = ()) -> None:
    """Prints a markdown table (ours, peer, ratio) and optionally writes the rows as JSON."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import triton

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n### {title}\n{stamp}, {gpu}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| case | unit | SITS | best peer | peer | ratio | SITS ms | peer ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.case} | {r.unit} | {r.ours:,.1f} | {r.peer:,.1f} | {r.peer_name} | {r.ratio:.2f}x "
            f"| {r.ours_ms:.4f} | {r.peer_ms:.4f} |"
        )
    for note in notes:
        print(f"\n{note}")
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(
                {"title": title, "date": stamp, "gpu": gpu, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]},
                f,
                indent=1,
            )
