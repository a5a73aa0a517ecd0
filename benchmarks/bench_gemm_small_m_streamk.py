"""The stream-K small-M GEMM against the launch the committed table routes each projection to, and cuBLAS.

    python benchmarks/bench_gemm_small_m_streamk.py [--m 1,32] [--proj qkv,o,down,gate_up] [--fold]

Llama-3-8B's projections in bf16 (gate_up as a plain GEMM over its 28,672 rows), at each M: the table's launch
(the direct or split-K kernel with its pinned config, or cuBLAS: what a decode step runs for an unfused
projection), cuBLAS (F.linear), and sits.kernels.gemm_small_m_streamk with each config of CONFIGS on the
device's multiprocessors (each with pointer loads of the weight and with TMA loads through a tensor
descriptor). Each is timed inside a CUDA graph (kernel_bench_utils.time_ms: 10 calls a graph,
median of 15 replays), rotating through weight copies of >= 256 MB so no weight is read from L2. Printed per
case: µs per call, TB/s of weight bytes, the ratio table launch / stream-K (> 1: stream-K is faster), and each
side's max error relative to the float64 product. --fold times the folded decoder norms' forms instead (what a
decode step runs at the fold buckets, runtime/models/norm_fold.py): o_proj and down_proj feeding the float32
stream, qkv_proj with its rows scaled by the norm's 1 / rms (`fold_launches`).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_gemm_small_m import L2_DEFEAT_BYTES, LLAMA3_8B
from kernel_bench_utils import rotating, time_ms

from sits.kernels.gemm_small_m import small_m_gemm, small_m_gemm_to_stream, sumsq_slots
from sits.kernels.gemm_small_m_splitk import small_m_gemm_splitk, small_m_gemm_splitk_to_stream
from sits.kernels.gemm_small_m_streamk import (
    counters_needed,
    small_m_gemm_streamk,
    small_m_gemm_streamk_to_stream,
)
from sits.kernels.small_m_table import load_small_m_table, m_bucket

PROJ = dict(LLAMA3_8B)  # Llama-3-8B's projections, [N, K] (the CPU test swaps in toy sizes)
DEVICE, DTYPE = "cuda", torch.bfloat16  # (tests/kernels/test_gemm_small_m_streamk_bench.py runs a CPU toy)
# (BLOCK_N, BLOCK_K, warps, stages, programs per SM, weight through a TMA descriptor)
CONFIGS = [
    (64, 128, 4, 4, 1, 0), (64, 128, 4, 4, 2, 0), (64, 256, 4, 4, 1, 0), (64, 128, 4, 6, 1, 0), (128, 128, 8, 4, 1, 0),
    (32, 256, 4, 4, 2, 0), (64, 64, 4, 8, 2, 0),
    (64, 128, 4, 4, 1, 1), (64, 128, 4, 4, 2, 1), (64, 256, 4, 4, 1, 1), (64, 128, 4, 6, 1, 1), (128, 128, 8, 4, 1, 1),
    (64, 64, 4, 8, 2, 1), (128, 64, 4, 8, 1, 1),
    # Many small programs, as the fastest pure read of these bytes runs (8 a multiprocessor, bench_stream_floor.py)
    (32, 128, 4, 3, 8, 0), (32, 64, 4, 4, 8, 0), (64, 128, 4, 3, 4, 0), (32, 128, 4, 4, 4, 0),
]  # fmt: skip


def table_launch(n: int, k: int, m: int, table, counters: torch.Tensor):
    """(name, fn(x, w)) of the launch the table routes an [n, k] projection to at M rows."""
    bucket = m_bucket(m)
    config = table.pinned_configs("linear", n, k).get(bucket)
    if bucket in table.splitk_buckets(n, k):
        return f"splitk {config}", lambda x, w: small_m_gemm_splitk(x, w, counters, config=config)
    if bucket in table.direct_buckets("linear", n, k):
        return f"direct {config}", lambda x, w: small_m_gemm(x, w, config=config)
    return "cublas", F.linear


def fold_launches(name: str, m: int, table, counters: torch.Tensor):
    """The folded-norm form of a projection (runtime/models/norm_fold.py), as (name of the launch the engine runs,
    fn(x, w), stream-K fn(x, w, config), exact(x, w) -> float64 expected output, reset() before a checked call):
    o_proj and down_proj feed the float32 stream (the split-K or direct kernel's `to_stream` with the table's pinned
    config; timed calls keep adding to it, a checked call starts from the stream `exact` assumes), qkv_proj scales
    its rows by the norm's 1 / rms (the direct kernel with the table's pinned config, else autotuned)."""
    n, k = PROJ[name]
    bucket = m_bucket(m)
    config = table.pinned_configs("linear", n, k).get(bucket)
    if name == "qkv":
        sumsq = torch.rand(m, sumsq_slots(k), device=DEVICE) * 10
        rstd = torch.rsqrt(sumsq.double().sum(-1, keepdim=True) / k + 1e-5)
        return (f"direct scaled {config}", lambda x, w: small_m_gemm(x, w, config=config, sumsq=sumsq, eps=1e-5),
                lambda x, w, c: small_m_gemm_streamk(x, w, counters, config=c, sumsq=sumsq, eps=1e-5),
                lambda x, w: (x.double() @ w.double().T) * rstd, lambda: None)  # fmt: skip
    stream0 = torch.randn(m, n, device=DEVICE)
    stream = stream0.clone()
    if bucket in table.splitk_buckets(n, k):
        name_, engine = f"splitk to_stream {config}", lambda x, w: small_m_gemm_splitk_to_stream(
            x, w, counters, stream, config=config)[0]  # fmt: skip
    else:
        name_, engine = (
            f"direct to_stream {config}",
            lambda x, w: small_m_gemm_to_stream(x, w, stream, config)[0],
        )
    return (name_, engine, lambda x, w, c: small_m_gemm_streamk_to_stream(x, w, counters, stream, config=c)[0],
            lambda x, w: stream0.double() + x.double() @ w.double().T, lambda: stream.copy_(stream0))  # fmt: skip


def bench_case(name: str, m: int, table, fold: bool = False) -> dict:
    """Time one projection at M rows (with `fold`, its folded-norm form: `fold_launches`), print its line, and
    return {"table_us", "table_err", "cublas_us", "streamk": {config label: (µs, error)}, "failed": {config label:
    exception name}}."""
    n, k = PROJ[name]
    copies = max(1, -(-L2_DEFEAT_BYTES // (2 * n * k)))
    weights = [(torch.randn(n, k, device=DEVICE) * k**-0.5).to(DTYPE) for _ in range(copies)]
    x = torch.randn(m, k, device=DEVICE).to(DTYPE)
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device=DEVICE)
    if fold:
        table_name, table_fn, streamk_fn, exact_fn, reset = fold_launches(name, m, table, counters)
    else:
        table_name, table_fn = table_launch(n, k, m, table, counters)
        streamk_fn = lambda a, b, c: small_m_gemm_streamk(a, b, counters, config=c)  # noqa: E731
        exact_fn = lambda a, b: a.double() @ b.double().T  # noqa: E731
        reset = lambda: None  # noqa: E731
    exact = exact_fn(x, weights[0])

    def run(fn):
        us = time_ms(rotating(lambda i: fn(x, weights[i]), copies)) * 1e3
        reset()
        error = ((fn(x, weights[0]).double() - exact).abs().max() / exact.abs().max()).item()
        return us, error

    tb = lambda us: 2 * n * k / (us * 1e-6) / 1e12  # noqa: E731
    base_us, base_err = run(table_fn)
    cublas_us, _ = run(F.linear)
    line = [
        f"{name:7s} M{m:<3d} N{n:<6d} K{k:<6d} | table ({table_name}) {base_us:.2f} us {tb(base_us):.2f} TB/s "
        f"err {base_err:.1e} | cublas {cublas_us:.2f} us"
    ]
    best, measured, failed = None, {}, {}
    for bn, bk, warps, stages, per_sm, tma in CONFIGS:
        keys = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "PROGRAMS_PER_SM", "W_TMA")
        config = dict(zip(keys, (bn, bk, warps, stages, per_sm, tma), strict=True))
        label = f"n{bn}k{bk}w{warps}s{stages}p{per_sm}{'-tma' if tma else ''}"
        try:
            us, err = run(lambda a, b, c=config: streamk_fn(a, b, c))
        except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported, not fatal
            line.append(f"{label}: {type(exc).__name__}")
            failed[label] = type(exc).__name__
            continue
        line.append(f"{label} {us:.2f} us err {err:.1e}")
        measured[label] = (us, err)
        best = min(best or (us, config), (us, config), key=lambda t: t[0])
    assert counters.count_nonzero().item() == 0
    if best:
        line.insert(
            1,
            f"stream-K best {best[0]:.2f} us {tb(best[0]):.2f} TB/s | table / stream-K "
            f"{base_us / best[0]:.3f}x, cublas / stream-K {cublas_us / best[0]:.3f}x",
        )
    print(" | ".join(line), flush=True)
    return {
        "table_us": base_us,
        "table_err": base_err,
        "cublas_us": cublas_us,
        "streamk": measured,
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", default="1,32")
    parser.add_argument("--proj", default="qkv,o,down,gate_up")
    parser.add_argument(
        "--fold", action="store_true", help="the folded-norm forms of qkv, o and down instead"
    )
    args = parser.parse_args()
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    table = load_small_m_table(device_name=device_name)
    print(torch.__version__, device_name, flush=True)
    for m in (int(v) for v in args.m.split(",")):
        for name in args.proj.split(","):
            if args.fold and name not in ("qkv", "o", "down"):
                continue  # gate_up's folded form (+ SiLU·mul) has no stream-K kernel
            bench_case(name, m, table, args.fold)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
