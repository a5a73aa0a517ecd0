"""The fp8 GEMM's backend per shape: four backends' error and speed, and the table they give.

    python benchmarks/bench_fp8_accum.py [--json rows.json] [--table fp8_accum_table.json] [--quick | --m 16,32,64]
                                         [--update kernels/fp8_accum_table.json] [--check]

For each Llama-3-8B projection (qkv, o, gate_up, down) at M = 16 and 32 (decode batches of 1 to 16
and 17 to 32: the split-K kernel), 64, 128, 256, 512 (throughput-mode decode: 448 rounds up to
512), 1,024 to 16,384 (prefill chunks), the four backends of sits.kernels.fp8_accum run on the same e4m3 operands:
SITS's Triton fp8_gemm with precise (float32 promotion every 128 of K) and fast accumulation, and
torch._scaled_mm with rowwise scales, use_fast_accum off and on. Error: the relative Frobenius
error of a float32 output against float32 sums of the same operands (the accumulation's own
error; random normal activations and weights of std 0.02; a bf16 output where torch._scaled_mm
refuses float32, which counts the output's rounding too; the Triton kernel above 128 rows on its
first 256 rows, see ERROR_ROWS). Time: bf16 output, each backend in CUDA
graphs (kernel_bench_utils.time_ms), weights rotated through copies so no case is timed out of L2.
The rule `choose_backend` picks each shape's backend; `--table` writes the table the engine loads
(copy it to kernels/fp8_accum_table.json to use it; it applies on a GPU of the same name only),
rewritten after every shape so an interrupted run still leaves the shapes it measured. `--m` measures only
those M values; `--update TABLE` starts from TABLE's entries (measured on this GPU) and replaces the shapes
measured now, so a few buckets can be re-measured without the whole sweep (e.g. the decode buckets after a
new small-M kernel: `--m 16,32,64 --update kernels/fp8_accum_table.json --table new.json`).
`--check` then runs Fp8Linear layers with that table at M between buckets, eagerly and replayed from
CUDA graphs, against the reference, and the torch._scaled_mm fallback on operands it cannot take.
Prints one line per shape, a markdown table (chosen backend against precise Triton, the default
before the table), CHECK lines, one RESULT line, then the table as one JSON line (TABLE ...).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from kernel_bench_utils import Measurement, report, rotating, time_ms

from sits.kernels.fp8_accum import BACKENDS, AccumEntry, AccumTable, m_bucket, parse_accum_table
from sits.kernels.fp8_gemm import (
    SMALL_M,
    fp8_gemm,
    fp8_gemm_on,
    fp8_gemm_reference,
    fp8_gemm_scaled_mm,
    quantize_weight_fp8_per_channel,
)
from sits.kernels.fp8_quantize import quantize_fp8_per_token

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# Decode batches of 1 to 16 (the Triton kernel's 16-row tiles) and 17 to 32 (its 64-row tiles), then one bucket each.
M_VALUES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_M_VALUES = (32, 512, 4096)
DEVICE = "cuda"  # tests run the measurement at toy sizes on "cpu" (Triton's interpreter, PyTorch's CPU _scaled_mm)
L2_DEFEAT_BYTES = 256 << 20
# Every config of the Triton TMA kernel (M > SMALL_M) sums K in tiles of 128 in the same order, so an
# output element's rounding does not depend on M; its float32-output error is measured on this many
# rows, which tunes one extra float32-output bucket per shape instead of one per M.
ERROR_ROWS = 256


def _error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).norm() / expected.norm()).item()


def _sig(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else float(f"{value:.{digits}g}")


def _run(backend: str, a, sa, w, sw, out_dtype=torch.bfloat16) -> torch.Tensor:
    """One backend, straight (no fallback: a backend that cannot take the operands raises)."""
    if backend.startswith("scaled_mm"):
        return fp8_gemm_scaled_mm(a, sa, w, sw, out_dtype, fast_accum=backend == "scaled_mm_fast")
    return fp8_gemm(a, sa, w, sw, out_dtype=out_dtype, fast_accum=backend == "triton_fast")


def _backend_error(backend: str, a, sa, w, sw, expected: torch.Tensor) -> float | None:
    for out_dtype in (torch.float32, torch.bfloat16):
        try:
            return _error(_run(backend, a, sa, w, sw, out_dtype), expected)
        except (RuntimeError, NotImplementedError) as error:
            print(f"  {backend} with {out_dtype} output unavailable: {str(error)[:160]}", flush=True)
    return None


def _backend_ms(backend: str, sets: list) -> float | None:
    try:
        return time_ms(rotating(lambda i: _run(backend, *sets[i]), len(sets)))
    except (RuntimeError, NotImplementedError) as error:
        print(f"  {backend} unavailable: {str(error)[:160]}", flush=True)
        return None


def measure(m: int, n: int, k: int, label: str) -> tuple[Measurement, AccumEntry]:
    """Every backend on one shape: (the report row, the table entry)."""
    torch.manual_seed(m + n + k)
    copies = max(1, min(8, L2_DEFEAT_BYTES // (n * k + m * k)))
    sets = []
    for _ in range(copies):
        a, sa = quantize_fp8_per_token(torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE))
        w, sw = quantize_weight_fp8_per_channel(torch.randn(n, k, device=DEVICE) * 0.02)
        sets.append((a, sa, w, sw))
    a, sa, w, sw = sets[0]
    expected = fp8_gemm_reference(a, sa, w, sw, out_dtype=torch.float32)
    # Triton above SMALL_M: the first ERROR_ROWS rows (see ERROR_ROWS); elsewhere every row
    r = ERROR_ROWS if m > SMALL_M else m
    errors = {b: _backend_error(b, a[:r], sa[:r], w, sw, expected[:r]) if b.startswith("triton")
              else _backend_error(b, a, sa, w, sw, expected) for b in BACKENDS}
    del expected
    ms = {b: _backend_ms(b, sets) for b in BACKENDS}
    entry = AccumEntry.measured(m_bucket(m), n, k, {b: _sig(t) for b, t in ms.items()},
                                {b: _sig(e, 3) for b, e in errors.items()})

    def tflops(t: float) -> float:
        return 2 * m * n * k / (t * 1e-3) / 1e12

    chosen_ms, base_ms = entry.ms[entry.backend], entry.ms["triton"]
    print(f"{label} M{m} N{n} K{k}: " + " | ".join(
        f"{b} {'-' if ms[b] is None else f'{ms[b]:.4f} ms'} err {'-' if errors[b] is None else f'{errors[b]:.1e}'}"
        for b in BACKENDS) + f" -> {entry.backend} {base_ms / chosen_ms:.2f}x", flush=True)
    extra = {"chosen": entry.backend, "ms": entry.ms, "error": entry.error, "weight_copies": copies,
             "triton_vs_scaled_mm": None if ms["scaled_mm"] is None else ms["scaled_mm"] / base_ms}
    row = Measurement(f"{label} M{m} N{n} K{k} ({entry.backend})", "TFLOP/s", tflops(chosen_ms), tflops(base_ms),
                      "triton (precise)", chosen_ms, base_ms, extra)
    return row, entry


def _relative(out: torch.Tensor, expected: torch.Tensor) -> float:
    return _error(out, expected.float())


def check(table: AccumTable) -> list[str]:
    """The engine's dispatch on the GPU: Fp8Linear with `table` at M between buckets, eagerly and from
    CUDA graphs, against the reference; torch._scaled_mm's fallback. Returns the failures."""
    from sits.runtime.models.quantize import Fp8Linear

    failures = []

    def verdict(ok: bool, what: str) -> None:
        print(f"CHECK {'ok' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    for label, (n, k) in LLAMA3_8B.items():
        torch.manual_seed(n + k)
        w, sw = quantize_weight_fp8_per_channel(torch.randn(n, k, device=DEVICE) * 0.02)
        layer = Fp8Linear(w, sw, None, accum=table)
        for m in (1, 5, 20, 448, 1000, 3000):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
            with torch.no_grad():
                out = layer(x)
            expected = fp8_gemm_reference(*quantize_fp8_per_token(x), w, sw, out_dtype=torch.float32)
            error = _relative(out, expected)
            verdict(error < 5e-3 and out.dtype == torch.bfloat16,
                    f"{label} M{m} eager {layer.backend_for(m)} err {error:.1e}")
        for m in (24, 448):
            static = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
            with torch.no_grad():
                side = torch.cuda.Stream()  # warm on a side stream: autotune and plans outside the capture
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    layer(static)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = layer(static)
                static.copy_(torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE))
                graph.replay()
                eager = layer(static)
            diff = _relative(captured, eager)
            verdict(diff < 1e-3, f"{label} M{m} graph {layer.backend_for(m)} vs eager {diff:.1e}")
    # torch._scaled_mm cannot take a misaligned activation: the precise Triton kernel runs instead
    n, k = LLAMA3_8B["o"]
    w, sw = quantize_weight_fp8_per_channel(torch.randn(n, k, device=DEVICE) * 0.02)
    a, sa = quantize_fp8_per_token(torch.randn(100, k, dtype=torch.bfloat16, device=DEVICE))
    buffer = torch.empty(100 * k + 8, dtype=torch.float8_e4m3fn, device=DEVICE)
    shifted = buffer[8:].view(100, k)
    shifted.copy_(a)
    for backend in ("scaled_mm", "scaled_mm_fast"):
        error = _relative(fp8_gemm_on(backend, shifted, sa, w, sw), fp8_gemm_reference(a, sa, w, sw, torch.float32))
        verdict(error < 5e-3, f"misaligned activation on {backend} (Triton fallback) err {error:.1e}")
    return failures


def _m_values(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--m takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--m takes comma-separated positive integers, got {text!r}")
    return values


def _starting_entries(path: str | None, device: str, parser: argparse.ArgumentParser) -> dict:
    """The entries of the table at `path` (none without one); a parser error if it is unreadable or
    was measured on another GPU (its speeds would mix two machines' figures)."""
    if path is None:
        return {}
    try:
        with open(path) as f:
            table = parse_accum_table(f.read())
    except (OSError, ValueError) as error:
        parser.error(f"--update {path}: {error}")
    if table.device != device:
        parser.error(f"--update {path}: measured on {table.device or 'an unnamed device'!r}, this is {device!r}")
    return dict(table.entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="also write the measurements to this JSON file")
    parser.add_argument("--table", help="write the backend table (sits.kernels.fp8_accum) here")
    parser.add_argument("--quick", action="store_true", help=f"M = {', '.join(map(str, QUICK_M_VALUES))} only")
    parser.add_argument("--m", type=_m_values, help="comma-separated M values to measure (instead of all)")
    parser.add_argument("--update", help="start from this table (measured on this GPU): its other shapes are kept")
    parser.add_argument("--check", action="store_true", help="then check the engine's dispatch with the table")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference sums in float32
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    rows, entries = [], _starting_entries(args.update, device, parser)
    for m in args.m or (QUICK_M_VALUES if args.quick else M_VALUES):
        for name, (n, k) in LLAMA3_8B.items():
            row, entry = measure(m, n, k, name)
            rows.append(row)
            entries[(entry.m_bucket, entry.n, entry.k)] = entry
            if args.table:
                with open(args.table, "w") as f:
                    f.write(AccumTable(device, entries).to_json())
    table = AccumTable(device, entries)
    report("FP8 GEMM backend per shape: the chosen backend against precise Triton (the default before the table)",
           rows, args.json, ["Errors: relative, float32 output against float32 sums of the same e4m3 operands.",
                             f"Table: {table.describe()}"])
    failures = check(table) if args.check else []
    geo = math.exp(sum(math.log(r.ratio) for r in rows) / len(rows))
    decode = [r.ratio for r in rows if int(r.case.split(" M")[1].split()[0]) <= 512]
    scaled = [r.extra["triton_vs_scaled_mm"] for r in rows if r.extra["triton_vs_scaled_mm"]]
    print(f"RESULT fp8-modes: {table.describe()}; chosen vs precise Triton, geometric mean {geo:.2f}x "
          f"(M <= 512: {math.exp(sum(map(math.log, decode)) / max(len(decode), 1)):.2f}x); precise Triton vs "
          f"torch._scaled_mm precise {math.exp(sum(map(math.log, scaled)) / max(len(scaled), 1)):.2f}x; "
          f"checks: {'skipped' if not args.check else 'all passed' if not failures else f'{len(failures)} FAILED'}")
    print("TABLE " + json.dumps(json.loads(table.to_json()), separators=(",", ":")), flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
