"""The bf16 GEMM at decode batches (M <= 64): the small-M direct kernel against cuBLAS, plain and with SiLU·mul.

    python benchmarks/bench_gemm_small_m.py [--m 1,2,4,8,16,32,64] [--proj qkv,o,gate_up,down] [--json rows.json]
        [--table small_m_gemm_table.json] [--no-configs] [--budget-s S]
    python benchmarks/bench_gemm_small_m.py --cpu-toy [...]   # toy sizes through Triton's interpreter, on the CPU

For each Llama-3-8B projection (nn.Linear weight [N, K] in bf16) and each M, in the same process:
  * cublas: torch.nn.functional.linear, what nn.Linear runs (cuBLAS, split-K at these shapes);
  * direct: sits.kernels.gemm_small_m.small_m_gemm, the autotuner's pick for (N, K, M bucket), and before
    it each GPU config alone (`configs`: the raw kernel, no autotuning; configs whose pipeline overflows
    shared memory at this row tile are listed as skipped);
  * splitk: sits.kernels.gemm_small_m_splitk.small_m_gemm_splitk (K split over programs, reduced in the same
    launch), its pick and each of its configs alone, the same way;
  * gate_up also as the MLP's activation step: cublas+silu (F.linear, then sits.kernels.silu_mul.silu_mul)
    against direct+silu (small_m_gemm_silu_mul: one launch, no [M, 2I] intermediate);
  * at M <= 8, qkv and gate_up+silu with the decoder norm before them (the residual add into a float32
    stream and the RMSNorm, sits.kernels.rmsnorm.rms_norm): norm+cublas (rms_norm, then F.linear [+ silu_mul]),
    norm+direct (rms_norm, then the direct kernel) and fused (sits.kernels.gemm_small_m_norm: the norm in the
    direct kernel's prologue, one launch), and the norm alone; "prologue" is fused minus the direct kernel
    alone (what the first pass and the rows' re-reads cost), to set beside the norm launch it saves.
Each is timed inside a CUDA graph (10 calls per graph, median of 15 replays; kernel_bench_utils.time_ms),
rotating through weight copies of >= 256 MB together so no weight is read from L2 (50 MB on an H200).
Printed per case: microseconds per call, TB/s of weight bytes (2 N K per call, the traffic's floor), the
ratio cublas / direct (> 1: the direct kernel is faster), the max relative error of each side against
float32 sums, the autotuner's pick. Per M: one decode step's 32 layers x (qkv, o, gate_up, down) under
cuBLAS, under the direct kernel and under the winners (the same with the activation: cublas+silu,
direct+silu); at M <= 8 also the step's 32 x (norm + qkv, norm + gate_up + silu) unfused (the faster of
norm+cublas and norm+direct) against fused. --table writes the winners per (op, N, K, M bucket), the norm
ops ("norm_linear", "norm_silu_mul": fused against the faster unfused side) included
(sits.kernels.small_m_table; copy it to
kernels/small_m_gemm_table.json to use it, it applies on a GPU of the same name only). --json writes the
rows after each case (a run cut short keeps what it measured).
"""

from __future__ import annotations

import os
import sys

if "--cpu-toy" in sys.argv:  # the interpreter must be on before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernel_bench_utils import hbm_copy_gbps, rotating, time_ms  # noqa: E402

from sits.kernels import gemm_small_m, gemm_small_m_norm, gemm_small_m_splitk  # noqa: E402
from sits.kernels.reference import small_m_norm_gemm_reference, small_m_norm_gemm_silu_mul_reference  # noqa: E402
from sits.kernels.rmsnorm import rms_norm  # noqa: E402
from sits.kernels.silu_mul import silu_mul  # noqa: E402
from sits.kernels.small_m_table import NORM_MAX_M, SmallMEntry, SmallMTable, choose_winner, m_bucket  # noqa: E402

L2_DEFEAT_BYTES = 256 << 20
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOY = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 80)}
LAYERS = 32
DTYPE = torch.bfloat16
NORM_PROJS = {"qkv": "norm_linear", "gate_up": "norm_silu_mul"}  # the projections a decoder norm feeds
EPS = 1e-5


class Setup:
    """Where and how the run measures: the GPU (CUDA graphs) or, with --cpu-toy, the CPU (wall clock)."""

    def __init__(self, cpu_toy: bool) -> None:
        self.device = "cpu" if cpu_toy else "cuda"
        self.shapes = TOY if cpu_toy else LLAMA3_8B
        self.time_ms = _wall_ms if cpu_toy else time_ms
        self.l2_bytes = 0 if cpu_toy else L2_DEFEAT_BYTES


def _wall_ms(fn) -> float:
    """The CPU toy's timer: one call after a warm-up, wall clock (only the flow is checked there)."""
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def short(config) -> str:
    """A config as BLOCK_N x BLOCK_K, operand order, warps and stages (e.g. n32k256-swap-w4s4)."""
    if config is None:
        return "none"
    kw = config.kwargs
    split = f"-split{kw['SPLIT_K']}" if "SPLIT_K" in kw else ""
    return (f"n{kw['BLOCK_N']}k{kw['BLOCK_K']}-{'swap' if kw['SWAP_AB'] else 'ab'}-w{config.num_warps}"
            f"s{config.num_stages}{split}")


def _raw_call(config, x, w, out, silu_mul: bool):
    """One launch of the raw kernel with `config` (no autotuning)."""
    meta = dict(config.kwargs, EVEN_K=x.shape[1] % config.kwargs["BLOCK_K"] == 0, num_warps=config.num_warps,
                num_stages=config.num_stages)  # fmt: skip
    gemm_small_m.launch(gemm_small_m._small_m_gemm_kernel, x, w, out, silu_mul, **meta)


def _time(setup: Setup, row: dict, side: str, call, copies: int, ref: torch.Tensor, weight_bytes: int) -> None:
    """Time `call(i)` (i: the weight copy) into row[side_us], its TB/s and its error; a failure is recorded."""
    try:
        us = setup.time_ms(rotating(call, copies)) * 1e3
        row[f"{side}_us"] = us
        row[f"{side}_tbps"] = weight_bytes / (us * 1e-6) / 1e12
        row[f"{side}_err"] = _max_rel_err(call(0), ref)
    except Exception as error:  # noqa: BLE001 - report the failure, keep measuring the others
        row[f"{side}_error"] = f"{type(error).__name__}: {str(error)[:300]}"


def _time_splitk_configs(setup: Setup, row: dict, x, ws, ref, weight_bytes: int) -> None:
    """Each split-K GPU config alone (pinned: the raw kernel): row["splitk_configs"] = {config: µs, or why not}."""
    figures: dict[str, float | str] = {}
    out = torch.empty(ref.shape, dtype=DTYPE, device=setup.device)
    counters = torch.zeros(gemm_small_m_splitk.counters_needed(ref.shape[1]), dtype=torch.int32, device=setup.device)
    block_m = gemm_small_m._block_m(x.shape[0])
    for config in gemm_small_m_splitk.GPU_CONFIGS:
        if gemm_small_m_splitk._smem(config, block_m) > gemm_small_m.SMEM_BYTES:
            figures[short(config)] = "skipped (shared memory)"
            continue
        cell: dict = {}
        _time(setup, cell, "c", lambda i, c=config_dict(config): gemm_small_m_splitk.small_m_gemm_splitk(
            x, ws[i], counters, out=out, config=c), len(ws), ref, weight_bytes)
        figures[short(config)] = round(cell["c_us"], 2) if "c_us" in cell else cell["c_error"]
    row["splitk_configs"] = figures


def _time_configs(setup: Setup, row: dict, prefix: str, x, ws, silu_mul: bool, ref, weight_bytes: int) -> None:
    """Each GPU config alone: row[prefix + "configs"] = {config: µs, or the reason it did not run}."""
    figures: dict[str, float | str] = {}
    out = torch.empty(ref.shape, dtype=DTYPE, device=setup.device)
    block_m = gemm_small_m._block_m(x.shape[0])
    for config in gemm_small_m.GPU_CONFIGS:
        if gemm_small_m.shared_memory_bytes(config, block_m, silu_mul) > gemm_small_m.SMEM_BYTES:
            figures[short(config)] = "skipped (shared memory)"
            continue
        cell: dict = {}
        _time(setup, cell, "c", lambda i, c=config: _raw_call(c, x, ws[i], out, silu_mul) or out, len(ws), ref,
              weight_bytes)  # fmt: skip
        figures[short(config)] = round(cell["c_us"], 2) if "c_us" in cell else cell["c_error"]
    row[f"{prefix}configs"] = figures


def bench_case(setup: Setup, name: str, m: int, n: int, k: int, configs: bool) -> dict:
    """Times every side of one shape; returns a row of figures (µs, TB/s, errors, the configs' µs)."""
    weight_bytes = n * k * DTYPE.itemsize
    copies = max(2, min(8, setup.l2_bytes // weight_bytes)) if setup.l2_bytes else 2
    x = torch.randn(m, k, dtype=DTYPE, device=setup.device)
    ws = [(torch.randn(n, k, device=setup.device) * k**-0.5).to(DTYPE) for _ in range(copies)]
    ref = x.float() @ ws[0].float().t()
    row: dict = {"proj": name, "m": m, "n": n, "k": k, "m_bucket": m_bucket(m), "weight_copies": copies}
    if configs:
        _time_configs(setup, row, "", x, ws, False, ref, weight_bytes)
    _time(setup, row, "cublas", lambda i: F.linear(x, ws[i]), copies, ref, weight_bytes)
    _time(setup, row, "direct", lambda i: gemm_small_m.small_m_gemm(x, ws[i]), copies, ref, weight_bytes)
    row["direct_config"] = short(getattr(gemm_small_m._small_m_gemm, "best_config", None))
    counters = torch.zeros(gemm_small_m_splitk.counters_needed(n), dtype=torch.int32, device=setup.device)
    if configs:
        _time_splitk_configs(setup, row, x, ws, ref, weight_bytes)
    _time(setup, row, "splitk", lambda i: gemm_small_m_splitk.small_m_gemm_splitk(x, ws[i], counters), copies, ref,
          weight_bytes)  # fmt: skip
    row["splitk_config"] = short(getattr(gemm_small_m_splitk._small_m_gemm_splitk, "best_config", None))
    if name == "gate_up":
        gate, up = ref.chunk(2, dim=-1)
        silu_ref = F.silu(gate) * up
        if configs:
            _time_configs(setup, row, "silu_", x, ws, True, silu_ref, weight_bytes)
        _time(setup, row, "cublas_silu", lambda i: silu_mul(F.linear(x, ws[i])), copies, silu_ref, weight_bytes)
        _time(setup, row, "direct_silu", lambda i: gemm_small_m.small_m_gemm_silu_mul(x, ws[i]), copies, silu_ref,
              weight_bytes)  # fmt: skip
        row["direct_silu_config"] = short(getattr(gemm_small_m._small_m_gemm_silu, "best_config", None))
    if configs:  # each side at the fastest of its configs and the autotuner's pick, that config pinned
        _pin(row, "direct", row.get("configs", {}), gemm_small_m.GPU_CONFIGS, gemm_small_m._small_m_gemm)
        _pin(row, "splitk", row.get("splitk_configs", {}), gemm_small_m_splitk.GPU_CONFIGS,
             gemm_small_m_splitk._small_m_gemm_splitk)
        if name == "gate_up":
            _pin(row, "direct_silu", row.get("silu_configs", {}), gemm_small_m.GPU_CONFIGS,
                 gemm_small_m._small_m_gemm_silu)
    row["winner"] = choose_winner(row.get("direct_us"), row.get("cublas_us"), row.get("splitk_us"))
    if name == "gate_up":
        row["silu_winner"] = choose_winner(row.get("direct_silu_us"), row.get("cublas_silu_us"))
    if name in NORM_PROJS and m <= NORM_MAX_M:
        bench_norm(setup, row, ws, name == "gate_up", weight_bytes)
    return row


def config_dict(config) -> dict[str, int]:
    """A triton.Config as a table's pinned config (sits.kernels.small_m_table.CONFIG_KEYS, SPLIT_K if it has one)."""
    pinned = {key: int(config.kwargs[key]) for key in ("BLOCK_N", "BLOCK_K", "SWAP_AB")}
    pinned |= {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return pinned | ({"SPLIT_K": int(config.kwargs["SPLIT_K"])} if "SPLIT_K" in config.kwargs else {})


def _pin(row: dict, side: str, figures: dict, configs: list, tuner) -> None:
    """row[side + "_pinned"]: the config of the side's fastest launch, each config alone (`figures`, µs by
    `short` name) or the autotuner's pick (row[side + "_us"]); the side's time becomes that launch's (the pick's
    own kept as side + "_pick_us")."""
    pick_us, pick = row.get(f"{side}_us"), getattr(tuner, "best_config", None)
    timed = [(figures[short(c)], c) for c in configs if isinstance(figures.get(short(c)), float)]
    if pick_us is not None and pick is not None:
        timed.append((pick_us, pick))
    if not timed:
        return
    us, config = min(timed, key=lambda t: t[0])
    if pick_us is not None:
        row[f"{side}_pick_us"] = pick_us
    row[f"{side}_us"] = us
    row[f"{side}_tbps"] = row["n"] * row["k"] * DTYPE.itemsize / (us * 1e-6) / 1e12
    row[f"{side}_pinned"] = config_dict(config)


def bench_norm(setup: Setup, row: dict, ws: list[torch.Tensor], silu: bool, weight_bytes: int) -> None:
    """The decoder norm before the projection (see the module doc), into row["norm_*"]: each side's µs, TB/s
    and error, the norm alone, the prologue's cost, the fused kernel's pick and the winner."""
    m, k, device = row["m"], row["k"], setup.device
    x = torch.randn(m, k, dtype=DTYPE, device=device)  # the sublayer's output
    residual = torch.randn(m, k, device=device) * 4  # the float32 stream
    norm_weight = (1 + 0.1 * torch.randn(k, device=device)).to(DTYPE)
    normed, stream = torch.empty_like(x), torch.empty_like(residual)
    reference = small_m_norm_gemm_silu_mul_reference if silu else small_m_norm_gemm_reference
    ref = reference(x, residual, norm_weight, EPS, ws[0])[0].float()
    gemm = gemm_small_m.small_m_gemm_silu_mul if silu else gemm_small_m.small_m_gemm
    fused = gemm_small_m_norm.small_m_norm_gemm_silu_mul if silu else gemm_small_m_norm.small_m_norm_gemm

    def norm():  # what TritonKernelOps.add_rms_norm launches (into a buffer of its own: the inputs stay put)
        return rms_norm(x, norm_weight, EPS, residual=residual, out=normed, residual_out=stream)[0]

    def cublas(i: int) -> torch.Tensor:
        return silu_mul(F.linear(norm(), ws[i])) if silu else F.linear(norm(), ws[i])

    sides = {"cublas": cublas, "direct": lambda i: gemm(norm(), ws[i]),
             "fused": lambda i: fused(x, residual, norm_weight, EPS, ws[i], residual_out=stream)[0]}
    for side, call in sides.items():
        _time(setup, row, f"norm_{side}", call, len(ws), ref, weight_bytes)
    row["norm_alone_us"] = setup.time_ms(norm) * 1e3
    plain = row.get("direct_silu_us" if silu else "direct_us")
    if "norm_fused_us" in row and plain is not None:
        row["norm_prologue_us"] = row["norm_fused_us"] - plain
    tuner = gemm_small_m_norm._norm_gemm_silu if silu else gemm_small_m_norm._norm_gemm
    row["norm_fused_config"] = short(getattr(tuner, "best_config", None))
    unfused = [row[f"norm_{side}_us"] for side in ("cublas", "direct") if f"norm_{side}_us" in row]
    row["norm_winner"] = choose_winner(row.get("norm_fused_us"), min(unfused) if unfused else None)


def _side(row: dict, side: str) -> str:
    if f"{side}_us" not in row:
        return f"{side}: FAILED {row.get(f'{side}_error')}"
    return f"{side} {row[f'{side}_us']:7.2f} us {row[f'{side}_tbps']:5.2f} TB/s err {row[f'{side}_err']:.1e}"


def format_row(row: dict) -> str:
    """One case in one line (two for gate_up): both sides, the ratio, the winner, the configs' µs."""

    def ratio(a: str, b: str) -> str:
        return f"{row[f'{a}_us'] / row[f'{b}_us']:.2f}x" if f"{a}_us" in row and f"{b}_us" in row else "n/a"

    def configs(prefix: str) -> str:
        figures = row.get(f"{prefix}configs", {})
        return " ".join(f"{c}={t}" for c, t in figures.items() if not isinstance(t, str) or "skipped" not in t)

    head = f"{row['proj']:7s} M{row['m']:<3d} N{row['n']:<5d} K{row['k']:<5d} | "
    lines = [head + f"{_side(row, 'cublas')} | {_side(row, 'direct')} | cublas/direct {ratio('cublas', 'direct')} "
             f"| winner {row['winner']} | pick {row['direct_config']} | configs (us): {configs('')}",
             head + f"{_side(row, 'splitk')} | cublas/splitk {ratio('cublas', 'splitk')} direct/splitk "
             f"{ratio('direct', 'splitk')} | pick {row['splitk_config']} | configs (us): {configs('splitk_')}"]
    if "silu_winner" in row:
        lines.append(head + f"{_side(row, 'cublas_silu')} | {_side(row, 'direct_silu')} | cublas+silu/direct+silu "
                     f"{ratio('cublas_silu', 'direct_silu')} | winner {row['silu_winner']} | pick "
                     f"{row['direct_silu_config']} | configs (us): {configs('silu_')}")
    if "norm_winner" in row:
        prologue = f"{row['norm_prologue_us']:.2f}" if "norm_prologue_us" in row else "n/a"
        lines.append(head + f"norm {row['norm_alone_us']:.2f} us | {_side(row, 'norm_cublas')} | "
                     f"{_side(row, 'norm_direct')} | {_side(row, 'norm_fused')} | norm+cublas/fused "
                     f"{ratio('norm_cublas', 'norm_fused')} norm+direct/fused {ratio('norm_direct', 'norm_fused')} | "
                     f"prologue {prologue} us | winner {row['norm_winner']} | pick {row['norm_fused_config']}")
    return "\n".join(lines)


def step_sums(rows: list[dict]) -> dict[str, float]:
    """One decode step's LAYERS x (qkv, o, gate_up, down) in µs per side: cuBLAS, direct, the winners; and
    the same with gate_up's activation (cublas+silu, direct+silu, winners)."""
    def us(row: dict, side: str) -> float:
        return row.get(f"{side}_us", float("nan"))

    def best(row: dict, plain: bool) -> float:
        if plain or row["proj"] != "gate_up":
            return us(row, row["winner"])
        return us(row, "direct_silu" if row["silu_winner"] == "direct" else "cublas_silu")

    sums = {
        "cublas": sum(us(r, "cublas") for r in rows),
        "direct": sum(us(r, "direct") for r in rows),
        "splitk": sum(us(r, "splitk") for r in rows),
        "winners": sum(best(r, True) for r in rows),
        "cublas+silu": sum(us(r, "cublas_silu" if r["proj"] == "gate_up" else "cublas") for r in rows),
        "direct+silu": sum(us(r, "direct_silu" if r["proj"] == "gate_up" else "direct") for r in rows),
        "winners+silu": sum(best(r, False) for r in rows),
    }
    return {side: LAYERS * total for side, total in sums.items()}


def norm_step_sums(rows: list[dict]) -> dict[str, float]:
    """One decode step's LAYERS x (norm + qkv, norm + gate_up + silu) in µs: unfused (the faster of
    norm+cublas and norm+direct per projection), fused, and the winners (what the table installs)."""
    measured = [r for r in rows if "norm_winner" in r]

    def unfused(r: dict) -> float:
        return min(r.get("norm_cublas_us", float("nan")), r.get("norm_direct_us", float("nan")))

    def fused(r: dict) -> float:
        return r.get("norm_fused_us", float("nan"))

    sums = {"unfused": sum(unfused(r) for r in measured), "fused": sum(fused(r) for r in measured),
            "winners": sum(fused(r) if r["norm_winner"] == "direct" else unfused(r) for r in measured)}
    return {side: LAYERS * total for side, total in sums.items()}


def winners_table(rows: list[dict], device: str) -> SmallMTable:
    """The measured winners as the engine's table: op "linear" for every row, "silu_mul" for gate_up's."""
    entries = {}
    for r in rows:
        cases = [("linear", {"direct": "direct", "splitk": "splitk", "cublas": "cublas"}, r["winner"])]
        if "silu_winner" in r:
            cases.append(("silu_mul", {"direct": "direct_silu", "cublas": "cublas_silu"}, r["silu_winner"]))
        for op, keys, winner in cases:
            us = {side: round(r[f"{key}_us"], 3) for side, key in keys.items() if f"{key}_us" in r}
            pinned = r.get(f"{keys[winner]}_pinned") if winner in keys and winner != "cublas" else None
            entries[(op, r["n"], r["k"], r["m_bucket"])] = SmallMEntry(op, r["n"], r["k"], r["m_bucket"], winner, us,
                                                                       pinned)
        if "norm_winner" in r:  # "direct": the fused launch; "cublas": the unfused path
            op = NORM_PROJS[r["proj"]]
            us = {side: round(r[f"norm_{key}_us"], 3) for side, key in
                  (("direct", "fused"), ("cublas", "cublas"), ("norm_direct", "direct")) if f"norm_{key}_us" in r}
            entries[(op, r["n"], r["k"], r["m_bucket"])] = SmallMEntry(op, r["n"], r["k"], r["m_bucket"],
                                                                       r["norm_winner"], us)
    return SmallMTable(device, entries)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,2,4,8,16,32,64", help="comma-separated batch sizes, in the order to run")
    parser.add_argument("--proj", default="qkv,o,gate_up,down", help="comma-separated Llama-3-8B projections")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--table", help="write the winners per (op, N, K, M bucket) to this table file")
    parser.add_argument("--no-configs", action="store_true", help="time only the autotuned pick, not each config")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new case after this many seconds (the summary and table still follow)")
    parser.add_argument("--cpu-toy", action="store_true",
                        help="toy shapes on the CPU through Triton's interpreter, wall-clock timed (a flow check)")
    return parser.parse_args()


def _summarize(rows: list[dict], projs: list[str], m: int) -> None:
    measured = [r for r in rows if r["m"] == m]
    if len(measured) < len(projs):
        return
    sums = step_sums(measured)
    print(f"M{m}: one decode step's {LAYERS} x ({', '.join(projs)}), ms: "
          + ", ".join(f"{side} {value / 1e3:.3f}" for side, value in sums.items())
          + f" | cublas/winners {sums['cublas'] / sums['winners']:.3f}x, "
          f"cublas+silu/winners+silu {sums['cublas+silu'] / sums['winners+silu']:.3f}x", flush=True)
    if any("norm_winner" in r for r in measured):
        norms = norm_step_sums(measured)
        print(f"M{m}: one decode step's {LAYERS} x (norm + qkv, norm + gate_up + silu), ms: "
              + ", ".join(f"{side} {value / 1e3:.3f}" for side, value in norms.items())
              + f" | unfused/fused {norms['unfused'] / norms['fused']:.3f}x", flush=True)


def main() -> None:
    args = _parse_args()
    setup = Setup(args.cpu_toy)
    torch.manual_seed(0)  # the same operands every run: errors (and the table they gate) reproduce
    started = time.monotonic()
    ms, projs = [int(v) for v in args.m.split(",")], args.proj.split(",")
    gpu = "cpu" if args.cpu_toy else torch.cuda.get_device_name()
    print(f"{gpu}, torch {torch.__version__}, {DTYPE}; "
          + ("CPU toy run (interpreter, wall clock)" if args.cpu_toy
             else "CUDA-graph timing (10 calls per graph, median of 15 replays)"), flush=True)
    if not args.cpu_toy:
        print(f"HBM copy bandwidth (eager, read + write): {hbm_copy_gbps() / 1e3:.2f} TB/s", flush=True)
    rows: list[dict] = []
    for m in ms:
        for name in projs:
            if time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: M{m} {name} and later cases not run", flush=True)
                break
            case_started = time.monotonic()
            rows.append(bench_case(setup, name, m, *setup.shapes[name], configs=not args.no_configs))
            print(format_row(rows[-1]) + f" | case took {time.monotonic() - case_started:.1f} s", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
        _summarize(rows, projs, m)
    if args.table:
        table = winners_table(rows, gpu)
        with open(args.table, "w") as f:
            f.write(table.to_json())
        print(f"table: {table.describe()} -> {args.table}", flush=True)
    print(f"total {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
