"""The floor of one kernel per operation at batch 1: how long a kernel that does nothing but read N bytes takes.

    python benchmarks/bench_stream_floor.py [--json rows.json]

At batch 1 a decode step is a chain of kernels that each stream one weight (or the live K / V) from HBM. A projection
takes about 5 µs more than its bytes at full bandwidth (benchmarks/RESULTS.md, Nsight Compute). This script asks how
much of that any kernel pays: a Triton kernel that only reads a bf16 buffer (P programs, each streaming its own
contiguous share in BLOCK-element tiles and writing one float32 sum) is timed at the byte counts of a Llama-3-8B
decode layer at batch 1:
  * attention: the live K and V of a 2,048-token context, 8 MiB;
  * qkv, o, gate_up, down: the four projections' bf16 weights;
  * lm_head: 128,256 x 4,096.
Each size is timed at every (programs per SM, BLOCK, warps) of CONFIGS in CUDA graphs (kernel_bench_utils.time_ms),
rotating over copies of >= 256 MB so nothing is read from L2; the fastest is that size's floor. Its peer, in the same
run, is cuBLAS (F.linear at M = 1) on the same weight: the ratio is cuBLAS's time over the floor. A least-squares fit
of floor = a + bytes / BW over the sizes gives each launch's fixed cost a.

Then one layer as five such kernels back to back in one graph (qkv, attention, o, gate_up, down, each at its best
config), and a step's floor under one kernel per operation: 32 layers of that chain plus lm_head's floor, to set beside
the engine's decode step (benchmarks/profile_decode.py).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_gemm_small_m import LLAMA3_8B
from kernel_bench_utils import Measurement, parse_args, report, rotating, time_ms

from sits.kernels.launch_utils import num_sms

DEVICE = "cuda"
DTYPE = torch.bfloat16
L2_DEFEAT_BYTES = 256 << 20
LAYERS = 32
VOCAB, HIDDEN = 128256, 4096
ATTENTION_BYTES = 2048 * 8 * 128 * 2 * 2  # K and V of 2,048 tokens, 8 KV heads, head_dim 128, bf16
# (programs per SM, BLOCK elements, num_warps)
CONFIGS = [(pps, block, warps) for pps in (1, 2, 4, 8) for block in (2048, 8192) for warps in (4, 8)]


@triton.jit
def _stream_kernel(src, out, n_elems, chunk, BLOCK: tl.constexpr):
    """Program p sums src[p * chunk : (p + 1) * chunk] (bf16, as float32) and writes it to out[p]."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * chunk
    end = tl.minimum(start + chunk, n_elems)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(start, end, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < end, other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def stream_read(src: torch.Tensor, out: torch.Tensor, config: tuple[int, int, int]) -> torch.Tensor:
    """Read all of src (1-D) with `config` = (programs per SM, BLOCK, warps); out[:programs] gets the partial sums."""
    per_sm, block, warps = config
    programs = per_sm * num_sms(src.device)
    chunk = triton.cdiv(triton.cdiv(src.numel(), programs), block) * block
    _stream_kernel[(programs,)](src, out, src.numel(), chunk, BLOCK=block, num_warps=warps)
    return out[:programs]


def sizes() -> dict[str, int]:
    """Bytes read by each operation of a batch-1 decode layer, and lm_head's."""
    table = {name: 2 * n * k for name, (n, k) in LLAMA3_8B.items()}
    return {"qkv": table["qkv"], "attention": ATTENTION_BYTES, "o": table["o"], "gate_up": table["gate_up"],
            "down": table["down"], "lm_head": 2 * VOCAB * HIDDEN}


def _copies(nbytes: int) -> list[torch.Tensor]:
    count = max(2, -(-L2_DEFEAT_BYTES // nbytes)) if L2_DEFEAT_BYTES else 1
    return [torch.randn(nbytes // 2, dtype=DTYPE, device=DEVICE) for _ in range(count)]


def floor_of(buffers: list[torch.Tensor], out: torch.Tensor) -> tuple[float, tuple[int, int, int]]:
    """(the fastest µs per read of one buffer over CONFIGS, that config); checks the sums of the first copy."""
    expected, magnitude = buffers[0].double().sum(), buffers[0].double().abs().sum()
    for config in CONFIGS:
        partial = stream_read(buffers[0], out, config).double().sum()
        assert abs(partial - expected) <= 1e-5 * magnitude, (config, float(partial), float(expected))
    timed = {c: time_ms(rotating(lambda i, c=c: stream_read(buffers[i], out, c), len(buffers))) * 1e3 for c in CONFIGS}
    best = min(timed, key=timed.get)
    return timed[best], best


def cublas_us(name: str) -> float:
    """F.linear at M = 1 on the projection's weight (rotated like the floor's buffers), µs per call."""
    n, k = (VOCAB, HIDDEN) if name == "lm_head" else LLAMA3_8B[name]
    weights = [w.view(n, k) for w in _copies(2 * n * k)]
    x = torch.randn(1, k, dtype=DTYPE, device=DEVICE)
    return time_ms(rotating(lambda i: F.linear(x, weights[i]), len(weights))) * 1e3


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of µs = a + bytes / BW: (a in µs, BW in TB/s)."""
    xs, ys = [b for b, _ in points], [us for _, us in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, 1e-6 / slope if slope > 0 else float("inf")


def chain_us(layer: dict[str, tuple[list[torch.Tensor], tuple[int, int, int]]], out: torch.Tensor) -> float:
    """One layer's five reads back to back (each at its own best config), µs per layer."""
    count = min(len(buffers) for buffers, _ in layer.values())

    def call(i):
        for buffers, config in layer.values():
            stream_read(buffers[i], out, config)
    return time_ms(rotating(call, count)) * 1e3


def main() -> None:
    args = parse_args(__doc__)
    out = torch.empty(max(c[0] for c in CONFIGS) * num_sms(torch.device(DEVICE)), dtype=torch.float32, device=DEVICE)
    rows, notes, points, layer, floors = [], [], [], {}, {}
    for name, nbytes in sizes().items():
        buffers = _copies(nbytes)
        floors[name], config = floor_of(buffers, out)
        peer = cublas_us(name) if name != "attention" else float("nan")
        note = (f"{name:9s} {nbytes / 1e6:8.1f} MB | floor {floors[name]:7.2f} us ({nbytes / floors[name] / 1e6:.2f} "
                f"TB/s, {config}) | cuBLAS M=1 {peer:7.2f} us | cuBLAS / floor {peer / floors[name]:.3f}x")
        print(note, flush=True)
        notes.append(note)
        rows.append(Measurement(f"read {name} ({nbytes / 1e6:.1f} MB)", "us", floors[name], peer, "cuBLAS M=1",
                                floors[name] / 1e3, peer / 1e3, {"config": list(config), "bytes": nbytes}))
        points.append((nbytes, floors[name]))
        if name != "lm_head":
            layer[name] = (buffers[:2], config)
        del buffers
    a, bandwidth = fit([p for p in points if p[0] < 2 * VOCAB * HIDDEN])
    per_layer = chain_us(layer, out)
    step = LAYERS * per_layer + floors["lm_head"]
    summary = (f"fit over the layer's sizes: {a:.2f} us + bytes at {bandwidth:.2f} TB/s; one layer as five reads in "
               f"a graph {per_layer:.1f} us (the five alone: {sum(floors[n] for n in layer):.1f}); a step of "
               f"{LAYERS} layers + lm_head {step / 1e3:.3f} ms")
    print(summary, flush=True)
    notes.append(summary)
    report("Reading a decode layer's bytes, one kernel per operation (batch 1, Llama-3-8B)", rows, args.json, notes)


if __name__ == "__main__":
    main()
