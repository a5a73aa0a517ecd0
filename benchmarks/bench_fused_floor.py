"""Whether one launch per layer can beat one launch per operation at batch 1: a decode layer's five reads in one
persistent kernel with a grid barrier between them, against five kernels back to back.

    python benchmarks/bench_fused_floor.py [--json rows.json]

`bench_stream_floor.py` found that a kernel which only reads its bytes still pays about 2.8 µs a launch beyond them
(2026-12-04, H200: 2.84 µs + bytes at 4.37 TB/s), and a batch-1 decode step launches at least 161 of them: a floor
of 3.90 ms under one kernel per operation, against the 4.1 ms ITL target. Only work that crosses a kernel boundary
can go under it. Here the five operations of a Llama-3-8B layer (qkv, attention's K / V, o, gate_up, down) are read
by ONE launch: P programs, all resident at once, each streams its share of a phase, then waits at a grid barrier
until every program has finished that phase (what a data dependency between two operations needs) before it starts
the next; after the barrier it loads one float32 another program stored before it (an activation's round trip).
The barrier is a counter in global memory: each program adds 1 when it arrives and polls until the count reaches P
times the phase; the last program of the launch resets it. With PRELOAD tiles, a program loads the first PRELOAD
tiles of its next share before it waits, so the next weight is already streaming while the slowest program of the
phase finishes: no ramp at the boundary.

Timed in CUDA graphs over two copies of the layer (444 MB each, so nothing is read from L2):
  * the chain: the five reads as five `bench_stream_floor` kernels back to back (8 programs an SM, 2,048-element tiles,
    8 warps: each size's best on the H200), the peer;
  * one read of the layer's bytes in one buffer: no boundary at all, the ideal;
  * the fused launch at every (programs per SM, warps, PRELOAD) of CONFIGS.
A configuration whose programs are not all resident at once would wait forever at its first barrier; the polls stop
after SPIN_LIMIT and set a flag, and such a configuration is reported and skipped. The step column is 32 layers plus
lm_head's read alone: a batch-1 step if every layer were one such launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from bench_stream_floor import sizes, stream_read
from kernel_bench_utils import Measurement, parse_args, report, rotating, time_ms

from sits.kernels.grid_barrier import grid_barrier, grid_barrier_reset
from sits.kernels.launch_utils import num_sms

DEVICE = "cuda"
DTYPE = torch.bfloat16
LAYERS = 32
COPIES = 2
PHASES = ("qkv", "attention", "o", "gate_up", "down")
CHAIN_CONFIG = (8, 2048, 8)  # (programs per SM, BLOCK, warps) of each read in the chain
BLOCK = 2048
# (programs per SM, num_warps, PRELOAD[, NARROW])
# 8 programs an SM of 8 warps would not all be resident (64 warps of 40 registers): its barriers would give up. The
# last three read attention's K / V with 64 programs, as the decode attention does at batch 1 (8 KV heads x 8 splits).
CONFIGS = [(pps, warps, preload) for pps, warps in ((2, 8), (4, 4), (4, 8)) for preload in (0, 2, 8)]
CONFIGS += [(8, 4, 0), (8, 4, 1), (8, 4, 2)]  # 4 or 8 tiles of 4 warps (68-71 registers) would not fit 8 an SM
CONFIGS += [(8, 4, 0, 64), (8, 4, 2, 64), (4, 8, 8, 64)]
SPIN_LIMIT = 1 << 22  # polls before a program gives up on a barrier (flags the launch)


@triton.jit
def _share(n, pid, programs, BLOCK: tl.constexpr):
    """[start, end) of program pid's contiguous share of n elements (whole tiles; the last share may be short)."""
    chunk = tl.cdiv(tl.cdiv(n, programs), BLOCK) * BLOCK
    start = pid.to(tl.int64) * chunk
    return start, tl.minimum(start + chunk, n)


@triton.jit
def _preload(src, start, end, PRELOAD: tl.constexpr, BLOCK: tl.constexpr):
    """The sum of the first PRELOAD tiles of [start, end) (each load issued here, its sum taken when used)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t in tl.static_range(PRELOAD):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < end, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _stream(src, start, end, acc, BLOCK: tl.constexpr):
    for offset in range(start, end, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < end, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _phase(src, n, carry, out, counter, flag, phase, pid, programs, parts, spin_limit,
           PRELOAD: tl.constexpr, BLOCK: tl.constexpr):
    """Wait at the barrier after phase - 1 (with this phase's first tiles in flight), load the float32 another
    program stored in it, stream the rest of this phase's share (the phase cut in `parts` shares: programs past them
    have none); returns the program's running sum."""
    start, end = _share(n, pid, parts, BLOCK)
    early = _preload(src, start, end, PRELOAD, BLOCK)
    grid_barrier(counter, phase * programs, flag, spin_limit)
    upstream = tl.load(out + (pid + 1) % programs)  # the activation a real phase would read
    acc = _stream(src, start + PRELOAD * BLOCK, end, early, BLOCK)
    return carry + tl.sum(acc) + upstream * 0.0


@triton.jit
def _fused_kernel(s0, n0, s1, n1, s2, n2, s3, n3, s4, n4, out, counter, flag, spin_limit,
                  PRELOAD: tl.constexpr, BLOCK: tl.constexpr, NARROW: tl.constexpr = 0):
    """Grid (P,): the five phases in order with a grid barrier between them; out[pid] = the program's sum. NARROW > 0:
    the second phase (attention's K / V) is read by its first NARROW programs only, as a decode attention of that many
    programs would read it."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    start, end = _share(n0, pid, programs, BLOCK)
    total = tl.sum(_stream(s0, start, end, tl.zeros([BLOCK], dtype=tl.float32), BLOCK))
    tl.store(out + pid, total)
    narrow = tl.minimum(programs, NARROW) if NARROW > 0 else programs
    total = _phase(s1, n1, total, out, counter, flag, 1, pid, programs, narrow, spin_limit, PRELOAD, BLOCK)
    tl.store(out + pid, total)
    total = _phase(s2, n2, total, out, counter, flag, 2, pid, programs, programs, spin_limit, PRELOAD, BLOCK)
    tl.store(out + pid, total)
    total = _phase(s3, n3, total, out, counter, flag, 3, pid, programs, programs, spin_limit, PRELOAD, BLOCK)
    tl.store(out + pid, total)
    total = _phase(s4, n4, total, out, counter, flag, 4, pid, programs, programs, spin_limit, PRELOAD, BLOCK)
    tl.store(out + pid, total)
    grid_barrier_reset(counter, 5 * programs)


def fused_read(layer: list[torch.Tensor], out: torch.Tensor, counter: torch.Tensor, flag: torch.Tensor,
               config: tuple[int, ...], spin_limit: int | None = None) -> torch.Tensor:
    """Read the five 1-D buffers of `layer` in one launch, config = (programs per SM, warps, PRELOAD[, NARROW]).

    counter: [1] int32, zero before the first launch (each launch leaves it zero); flag: [1] int32, set to 1 by a
    launch whose barrier polls gave up. Returns out[:programs], each program's float32 sum of its shares.
    """
    per_sm, warps, preload, *narrow = config
    programs = per_sm * num_sms(out.device)
    args = [x for src in layer for x in (src, src.numel())]
    limit = SPIN_LIMIT if spin_limit is None else spin_limit
    _fused_kernel[(programs,)](*args, out, counter, flag, limit, PRELOAD=preload, BLOCK=BLOCK,
                               NARROW=narrow[0] if narrow else 0, num_warps=warps)
    return out[:programs]


def _layers() -> list[list[torch.Tensor]]:
    table = sizes()
    return [[torch.randn(table[name] // 2, dtype=DTYPE, device=DEVICE) for name in PHASES] for _ in range(COPIES)]


def check_fused(layer, out, counter, flag, config) -> bool:
    """Whether the launch completed every barrier (flag clear) and summed every element exactly once."""
    flag.zero_()
    partial = fused_read(layer, out, counter, flag, config).double().sum()
    if int(flag.item()) or int(counter.item()):
        counter.zero_()
        return False
    expected = sum(float(src.double().sum()) for src in layer)
    magnitude = sum(float(src.double().abs().sum()) for src in layer)
    assert abs(float(partial) - expected) <= 1e-5 * magnitude, (config, float(partial), expected)
    return True


def time_variants(layers, out, counter, flag) -> dict[str, float]:
    """µs per layer of the chain, the one-buffer read and every fused config that completes its barriers."""
    timings = {"chain": time_ms(rotating(lambda i: [stream_read(src, out, CHAIN_CONFIG) for src in layers[i]],
                                        len(layers))) * 1e3}
    whole = [torch.cat(layer) for layer in layers]
    timings["one buffer"] = time_ms(rotating(lambda i: stream_read(whole[i], out, CHAIN_CONFIG), len(whole))) * 1e3
    for config in CONFIGS:
        if not check_fused(layers[0], out, counter, flag, config):
            print(f"fused {config}: not every program resident (a barrier gave up); skipped", flush=True)
            continue
        timings[f"fused {config}"] = time_ms(rotating(lambda i, c=config: fused_read(layers[i], out, counter, flag, c),
                                                     len(layers))) * 1e3
        if int(flag.item()):
            raise RuntimeError(f"fused {config}: a barrier gave up inside the timed graph")
    return timings


def main() -> None:
    args = parse_args(__doc__)
    device = torch.device(DEVICE)
    out = torch.zeros(8 * num_sms(device), dtype=torch.float32, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    layers = _layers()
    lm_head = stream_read_us(sizes()["lm_head"], out)
    timings = time_variants(layers, out, counter, flag)
    chain = timings["chain"]
    rows, notes = [], []
    for name, us in timings.items():
        step = (LAYERS * us + lm_head) / 1e3
        note = (f"{name:24s} {us:7.2f} us a layer | chain / this {chain / us:.3f}x | a step of {LAYERS} layers + "
                f"lm_head {step:.3f} ms")
        print(note, flush=True)
        notes.append(note)
        rows.append(Measurement(f"layer read, {name}", "us", us, chain, "five kernels", us / 1e3, chain / 1e3,
                                {"step_ms": step}))
    report("A decode layer's reads in one launch with grid barriers against five launches (batch 1, Llama-3-8B)",
           rows, args.json, notes)


def stream_read_us(nbytes: int, out: torch.Tensor) -> float:
    """lm_head's read alone (one buffer, two copies rotated), µs."""
    copies = [torch.randn(nbytes // 2, dtype=DTYPE, device=DEVICE) for _ in range(COPIES)]
    return time_ms(rotating(lambda i: stream_read(copies[i], out, CHAIN_CONFIG), len(copies))) * 1e3


if __name__ == "__main__":
    main()
