"""The fp8 GEMM at decode batches (M <= 64): the atomic split-K path, the direct kernel, torch._scaled_mm.

    python benchmarks/bench_fp8_small_m.py [--m 32,64,1,16,8] [--proj o,qkv,down,gate_up] [--json out.json]
        [--no-check] [--budget-s S]
    python benchmarks/bench_fp8_small_m.py --precompile I/N   # N processes at once first: see `precompile`

For each Llama-3-8B projection (nn.Linear weight [N, K], e4m3 with per-channel scales) and each M,
in the same process and with each side's autotuning done before timing:
  * atomic: fp8_gemm(small_m_kernel="atomic"), what fp8_gemm ran at M <= SMALL_M before the direct
    kernel: a memset of a float32 buffer (the config pre-hook), the split-K GEMM adding into it
    atomically, and a cast kernel to bf16 (three launches);
  * direct: fp8_gemm(small_m_kernel="direct"), one launch writing bf16;
  * scaled_mm: torch._scaled_mm with rowwise scales, precise sums (use_fast_accum=False).
Each is timed inside a CUDA graph (10 calls per graph, median of 15 replays; kernel_bench_utils.time_ms),
what the decode step replays, rotating through several weight copies so that no weight is read out
of L2 (50 MB on an H200). Printed per case: microseconds per call, TB/s of weight bytes (N K bytes per
call: the floor of the traffic), the ratios, the max relative error of each side against
fp8_gemm_reference (max |out - ref| / max |ref|), and the config the direct kernel's autotuner picked.
Then per M: one decode step's projections (32 layers x the four) under each side, and which side
fp8_gemm's rule (`small_m_direct`) picks. Unless --no-check: first, every direct-kernel config is
checked against the reference at N = K = 4096 for each row tile the cases use (a config that fails
leaves the autotuning, reported); last, every config again at a ragged shape (M 5, N 1000, K 4160).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from kernel_bench_utils import hbm_copy_gbps, rotating, time_ms

from sits.kernels import fp8_gemm as fp8_gemm_module
from sits.kernels.fp8_gemm import (
    fp8_gemm,
    fp8_gemm_reference,
    fp8_gemm_scaled_mm,
    quantize_weight_fp8_per_channel,
    small_m_direct,
)
from sits.kernels.fp8_quantize import quantize_fp8_per_token

L2_DEFEAT_BYTES = 256 << 20
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
SIDES = ("atomic", "direct", "scaled_mm")


def _operands(m: int, n: int, k: int, copies: int):
    sets = []
    for _ in range(copies):
        a_fp8, a_scale = quantize_fp8_per_token(torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE))
        w_fp8, w_scale = quantize_weight_fp8_per_channel(torch.randn(n, k, device=DEVICE) * 0.02)
        sets.append((a_fp8, a_scale, w_fp8, w_scale))
    return sets


def _max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def bench_case(name: str, m: int, n: int, k: int) -> dict:
    """Times the three sides on one shape; returns a row of figures (microseconds, TB/s, errors)."""
    copies = max(2, min(8, L2_DEFEAT_BYTES // (n * k)))
    sets = _operands(m, n, k, copies)
    calls = {
        "atomic": lambda i: fp8_gemm(*sets[i], small_m_kernel="atomic"),
        "direct": lambda i: fp8_gemm(*sets[i], small_m_kernel="direct"),
        "scaled_mm": lambda i: fp8_gemm_scaled_mm(*sets[i]),
    }
    ref = fp8_gemm_reference(*sets[0], out_dtype=torch.float32)
    row: dict = {"proj": name, "m": m, "n": n, "k": k, "weight_copies": copies}
    direct_tuner = fp8_gemm_module._fp8_gemm_direct
    for side, call in calls.items():
        try:
            if side == "direct":
                direct_tuner.configs_timings = None  # set again when this case's key is tuned
            us = time_ms(rotating(call, copies)) * 1e3
            row[f"{side}_us"] = us
            row[f"{side}_tbps"] = n * k / (us * 1e-6) / 1e12
            row[f"{side}_err"] = _max_rel_err(call(0), ref)
        except Exception as error:  # noqa: BLE001 - report the failure, keep measuring the others
            row[f"{side}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        if side == "direct":
            row["direct_config"] = _short(getattr(direct_tuner, "best_config", None))
            timings = getattr(direct_tuner, "configs_timings", None) or {}
            # the autotuner keeps each config's figures at its quantiles (a list, the median first) or one float
            ms = {c: float(t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
            ranked = sorted(ms.items(), key=lambda item: item[1])
            row["direct_tuning_us"] = [(_short(c), round(t * 1e3, 2)) for c, t in ranked]
    row["rule_picks"] = "direct" if small_m_direct(m, n, k) else "atomic"
    return row


def _short(config) -> str:
    """A direct-kernel config as BLOCK_N x BLOCK_K, operand order, warps and stages (e.g. n32k256-ab-w4s4)."""
    if config is None:
        return "none"
    kw = config.kwargs
    order = "swap" if kw.get("SWAP_AB") else "ab"
    return f"n{kw.get('BLOCK_N')}k{kw.get('BLOCK_K')}-{order}-w{config.num_warps}s{config.num_stages}"


def _fmt(row: dict) -> str:
    def side(s):
        if f"{s}_us" not in row:
            return f"{s}: FAILED {row.get(f'{s}_error')}"
        return f"{s} {row[f'{s}_us']:7.2f} us {row[f'{s}_tbps']:5.2f} TB/s err {row[f'{s}_err']:.1e}"

    ratios = ""
    if "direct_us" in row:
        ratios = " | ".join(
            f"{s}/direct {row[f'{s}_us'] / row['direct_us']:.2f}x" for s in ("atomic", "scaled_mm") if f"{s}_us" in row
        )
    return (f"{row['proj']:7s} M{row['m']:<3d} N{row['n']:<5d} K{row['k']:<5d} | "
            + " | ".join(side(s) for s in SIDES) + f" | {ratios} | rule: {row['rule_picks']}"
            + f" | direct config: {row.get('direct_config')} | tuning (us, L2-warm): "
            + " ".join(f"{c}={t}" for c, t in row.get("direct_tuning_us", [])[:6]))  # fmt: skip


DEVICE = "cuda"
MAX_ERROR = 1e-2  # max relative error of a working config (precise sums land near 1e-3 in bf16)


def check_configs(m: int, n: int, k: int, drop_failing: bool = False) -> list:
    """Every GPU config of the direct kernel against the reference at one shape (bf16 out); returns the
    configs that failed (raised, or erred above MAX_ERROR). With drop_failing they also leave the
    autotuner's list, so one config that cannot build on this GPU does not sink the whole timing run.

    At N = K = 4096 this compiles exactly the binaries the autotuner of that row tile uses later (M is
    not specialized), so it costs little beyond the compilation the timed cases need anyway."""
    torch.manual_seed(0)
    ((a_fp8, a_scale, w_fp8, w_scale),) = _operands(m, n, k, 1)
    ref = fp8_gemm_reference(a_fp8, a_scale, w_fp8, w_scale, out_dtype=torch.float32)
    failed = []
    for config in list(fp8_gemm_module._DIRECT_CONFIGS):
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
        meta = dict(config.kwargs, EVEN_K=k % config.kwargs["BLOCK_K"] == 0, num_warps=config.num_warps,
                    num_stages=config.num_stages)  # fmt: skip
        try:
            fp8_gemm_module._launch_direct(fp8_gemm_module._fp8_gemm_direct_kernel, a_fp8, a_scale, w_fp8, w_scale,
                                           out, False, **meta)  # fmt: skip
            err = _max_rel_err(out, ref)
            verdict = f"max rel err {err:.1e}" + ("" if err < MAX_ERROR else " TOO LARGE")
            if err >= MAX_ERROR:
                failed.append(config)
        except Exception as error:  # noqa: BLE001 - report every config
            verdict = f"FAILED {type(error).__name__}: {str(error)[:200]}"
            failed.append(config)
        print(f"check M{m} N{n} K{k} {_short(config)}: {verdict}", flush=True)
    tuner = fp8_gemm_module._fp8_gemm_direct
    if drop_failing and failed and len(failed) < len(tuner.configs):
        tuner.configs[:] = [c for c in tuner.configs if c not in failed]
        print(f"dropped from the direct kernel's autotuning: {', '.join(_short(c) for c in failed)}", flush=True)
    return failed


def precompile(part: int, parts: int, ms: list[int], n: int = 4096, k: int = 4096) -> None:
    """Compile share `part` of `parts` of the binaries the timed cases need, into Triton's on-disk cache.

    Run in several processes at once before the timed run (Triton compiles one kernel at a time per
    process): each launches its share of (kernel, config, specialization) once at N = K = 4096, which
    has the integer and alignment classes of every Llama-3-8B projection, so the timed run's
    autotuning then loads the binaries instead of compiling them.
    """
    jobs = []
    for block_m in sorted({fp8_gemm_module._direct_block_m(m) for m in ms}):
        jobs += [("direct", max(block_m - 3, 8) if block_m > 16 else 8, c) for c in fp8_gemm_module._DIRECT_CONFIGS]
    atomic = fp8_gemm_module._fp8_gemm_small_m
    # the split-K kernel specializes M and its bucket on the value 1 and on multiples of 16
    atomic_ms = sorted({1 if m == 1 else 16 if m % 16 == 0 and m <= 16 else 32 if m % 16 == 0 else m for m in ms})
    for m in atomic_ms:
        bucket = fp8_gemm_module.length_bucket(m, cap=1 << 16)
        kept = fp8_gemm_module._prune_small_m(atomic.configs, {"M_BUCKET": bucket, "K": k})
        jobs += [("atomic", m, c) for c in kept]
    mine = jobs[part::parts]
    for kind, m, config in mine:
        ((a_fp8, a_scale, w_fp8, w_scale),) = _operands(m, n, k, 1)
        try:
            if kind == "direct":
                out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
                meta = dict(config.kwargs, EVEN_K=True, num_warps=config.num_warps, num_stages=config.num_stages)
                fp8_gemm_module._launch_direct(fp8_gemm_module._fp8_gemm_direct_kernel, a_fp8, a_scale, w_fp8,
                                               w_scale, out, False, **meta)  # fmt: skip
            else:
                acc = torch.zeros(m, n, dtype=torch.float32, device=DEVICE)
                fp8_gemm_module._fp8_gemm_kernel_even_k[fp8_gemm_module.split_k_grid(m, n)](
                    a_fp8, w_fp8, acc, a_scale, w_scale, m, n, k, a_fp8.stride(0), w_fp8.stride(0), acc.stride(0),
                    fp8_gemm_module.length_bucket(m, cap=1 << 16), ATOMIC=True, FAST_ACCUM=False,
                    **config.all_kwargs(),
                )  # fmt: skip
        except Exception as error:  # noqa: BLE001 - the timed run reports (and drops) what cannot build
            print(f"precompile {kind} M{m} {config}: {type(error).__name__}: {str(error)[:200]}", flush=True)
    torch.cuda.synchronize()
    print(f"precompiled {len(mine)} of {len(jobs)} binaries (part {part} of {parts})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="32,64,1,16,8", help="comma-separated batch sizes, in the order to run")
    parser.add_argument("--proj", default="o,qkv,down,gate_up", help="comma-separated Llama-3-8B projections")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--no-check", action="store_true", help="skip the per-config correctness check")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new case after this many seconds (the summary still prints)")
    parser.add_argument("--precompile", metavar="I/N",
                        help="only compile share I of N of the binaries into Triton's disk cache, then exit")
    args = parser.parse_args()
    started = time.monotonic()
    ms = [int(v) for v in args.m.split(",")]
    projs = args.proj.split(",")
    if args.precompile:
        part, parts = (int(v) for v in args.precompile.split("/"))
        precompile(part, parts, ms)
        return
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{gpu}, torch {torch.__version__}; CUDA-graph timing (10 calls per graph, "
          "median of 15 replays)", flush=True)  # fmt: skip
    print(f"HBM copy bandwidth (eager, read + write): {hbm_copy_gbps() / 1e3:.2f} TB/s", flush=True)
    if not args.no_check:  # every config at each row tile the cases use (16, 32, 64 rows) before timing
        for block_m in sorted({fp8_gemm_module._direct_block_m(m) for m in ms}):
            check_configs(block_m - 3 if block_m > 16 else 8, 4096, 4096, drop_failing=True)
    rows = []
    for m in ms:
        for name in projs:
            if time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: M{m} {name} and later cases not run", flush=True)
                break
            case_started = time.monotonic()
            rows.append(bench_case(name, m, *LLAMA3_8B[name]))
            print(_fmt(rows[-1]) + f" | case took {time.monotonic() - case_started:.1f} s", flush=True)
            if args.json:  # written after every row: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
        measured = [r for r in rows if r["m"] == m]
        if len(measured) < len(projs):
            continue
        step = {s: LAYERS * sum(r.get(f"{s}_us", float("nan")) for r in measured) for s in SIDES}
        step["fp8_gemm's rule"] = LAYERS * sum(r.get(f"{r['rule_picks']}_us", float("nan")) for r in measured)
        print(f"M{m}: one decode step's {LAYERS} x ({', '.join(projs)}): "
              + ", ".join(f"{s} {v / 1e3:.3f} ms" for s, v in step.items()), flush=True)  # fmt: skip
    if not args.no_check and time.monotonic() - started < args.budget_s:
        check_configs(5, 1000, 4160)  # ragged: N past the last column tile, K past the last K tile
    print(f"total {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
