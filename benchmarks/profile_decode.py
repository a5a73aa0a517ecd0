"""Where a decode step's time goes on the GPU: torch profiler over steady decode steps.

    python benchmarks/profile_decode.py --config llama-3-8b --batch 1 --input-len 2048 [--steps 30]
        [--mixed-prompt-tokens N [--mixed-prompts K]] [--chrome-trace PATH.json.gz]

Prefills `--batch` random prompts of `--input-len` tokens, warms up, then profiles `--steps` decode-only
steps of the engine as users run it (CUDA graphs, async scheduling unless flagged off). Prints:
- wall ms per step (host clock, the loop as `sits bench` runs it) and GPU-busy ms per step (the union
  of kernel intervals): their difference is time the GPU sat idle waiting for the host;
- the kernels by total GPU time, with calls per step and µs per call, and the launches per step;
- the floor: the bytes a step must read (weights + live KV) at the GPU's HBM bandwidth;
- the host's phases per step (median µs, `benchmarks/engine_phases.py`) over as many more steps: with
  async scheduling "sample" is the wait for the previous step's device work, so a step whose other
  phases add up to more than the GPU's time per step is paced by the host.
`--chrome-trace` writes the profiled steps' CPU and CUDA timeline (open it in Perfetto).
With `--mixed-prompt-tokens N` every measured step also computes one new N-token prompt (a fresh random
prompt added before the step, answered with one token, so the decode batch stays the same): the mixed
steps a served engine runs while streams arrive; `--mixed-prompts K` adds K such prompts a step (4 x 2,048
beside batch 1: a prefill step of the batch-32 2,048 / 512 bench at its 8,192-token budget). Those run
eagerly (CUDA graphs hold decode-only steps), so wall against GPU busy says how much of a mixed step the GPU
waits for the host's launches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1: import `benchmarks` from the root
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from benchmarks.engine_phases import PHASES, PhaseClock, instrument  # noqa: E402


def _busy_ms(events) -> float:
    """Union of the kernels' [start, end) intervals, ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, current_start, current_end = 0.0, None, None
    for start, end in spans:
        if current_end is None or start > current_end:
            if current_end is not None:
                busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    return busy / 1e3


def main(argv=None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sits.runtime.commands import bench
    from sits.runtime.commands.engine_args import configure_logging
    from sits.runtime.engine.request import SamplingParams
    from sits.runtime.gc_heap import frozen_startup_heap

    args = _parse_args(argv)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    args.output_len = max(args.output_len, args.steps + 64)
    configure_logging(args.log_level)
    config = bench.build_config(args)
    loaded = bench.load(args, config)
    engine = bench.new_engine(args, loaded, config)
    _start_decoding(engine, bench.random_prompts(args.batch, args.input_len, loaded.config.vocab_size, 7),
                    SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len,
                                   ignore_eos=True))
    step = _mixed_stepper(engine, args.mixed_prompt_tokens, args.mixed_prompts, 3 * args.steps,
                          loaded.config.vocab_size)
    with frozen_startup_heap("profile_decode"):  # as the engine process and `sits bench` run (gc_heap.py)
        sync()
        walls = []
        begin = time.perf_counter()
        for _ in range(args.steps):
            step()
            walls.append(time.perf_counter())
        sync()
        wall_ms = (time.perf_counter() - begin) * 1e3 / args.steps
        gaps = [(b - a) * 1e3 for a, b in zip([begin, *walls[:-1]], walls, strict=True)]
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
            sync()
        _report(args, prof, wall_ms, loaded, engine)
        print(f"wall per step call: median {statistics.median(gaps):.3f} ms, max {max(gaps):.3f} ms")
        _print_host_phases(engine, step, args.steps)
    if args.chrome_trace:
        _write_trace(prof, args.chrome_trace)
    return 0


def _parse_args(argv) -> argparse.Namespace:
    """The bench's flags and this script's, checked; the mixed steps' seats and context filled in."""
    from sits.runtime.commands import bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_bench_arguments(parser)
    parser.add_argument("--steps", type=int, default=30, help="decode steps profiled")
    parser.add_argument("--mixed-prompt-tokens", type=int, default=0, metavar="N",
                        help="each measured step also prefills new N-token prompts (0: decode-only steps)")
    parser.add_argument("--mixed-prompts", type=int, default=1, metavar="K",
                        help="how many N-token prompts each measured step prefills (default 1; K x N prompt "
                             "tokens must fit --max-num-batched-tokens beside the batch)")
    parser.add_argument("--chrome-trace", default=None, metavar="PATH",
                        help="write the profiled steps' timeline (Chrome trace JSON; gzipped if PATH ends in .gz)")
    args = parser.parse_args(argv)
    if args.mixed_prompt_tokens < 0:
        parser.error("--mixed-prompt-tokens must be 0 or a positive number of tokens")
    if args.mixed_prompts < 1:
        parser.error("--mixed-prompts must be at least 1")
    if args.mixed_prompt_tokens and args.max_num_seqs is None:
        # Room for the new prompts beside the whole batch and the previous step's: with async scheduling the
        # previous step's prompts still hold their seats when the next step is scheduled (they finished on
        # the token that step's call processes); with one set of seats only every other step would mix.
        args.max_num_seqs = args.batch + 2 * args.mixed_prompts
    if args.mixed_prompt_tokens and args.max_model_len is None:
        args.max_model_len = max(args.input_len + max(args.output_len, args.steps + 64),
                                 args.mixed_prompt_tokens + 1)
    return args


def _print_host_phases(engine, step, steps: int) -> None:
    """`steps` more steps with the engine's calls timed (`engine_phases`): median µs per phase."""
    clock = PhaseClock()
    instrument(engine, clock)
    timed: list[tuple[float, dict[str, float]]] = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        timed.append((time.perf_counter() - start, clock.take()))
    medians = {phase: statistics.median(p.get(phase, 0.0) for _, p in timed) * 1e6 for phase in PHASES[:-1]}
    medians["other"] = statistics.median(total - sum(p.values()) for total, p in timed) * 1e6
    wait = statistics.median(total - p.get("sample", 0.0) for total, p in timed) * 1e6
    print("\nhost phases (µs / step, median of " + str(steps) + " steps): "
          + ", ".join(f"{phase} {medians[phase]:,.0f}" for phase in PHASES)
          + f"; step {statistics.median(t for t, _ in timed) * 1e6:,.0f}, step less sample (the host's own) {wait:,.0f}")


def _write_trace(prof, path: str) -> None:
    """The profile's timeline as Chrome trace JSON, gzipped when `path` ends in .gz."""
    import gzip
    import os
    import tempfile

    if not path.endswith(".gz"):
        prof.export_chrome_trace(path)
        return
    with tempfile.TemporaryDirectory() as scratch:
        plain = os.path.join(scratch, "trace.json")
        prof.export_chrome_trace(plain)
        with open(plain, "rb") as source, gzip.open(path, "wb", compresslevel=6) as target:
            target.write(source.read())
    print(f"timeline: {path}")


def _report(args, prof, wall_ms: float, loaded, engine) -> None:
    """Wall against GPU busy per step, the floor, the kernel table."""
    import torch

    from sits.runtime.hardware import detect_gpu

    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:  # CPU: the operators instead
        kernels = [e for e in prof.events() if e.name.startswith("aten::")]
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in kernels:
        by_name[event.name].append(event.device_time or (event.time_range.end - event.time_range.start))
    total_us = sum(sum(v) for v in by_name.values())
    busy = _busy_ms(kernels) / args.steps
    mixed = (f" + {args.mixed_prompts} x {args.mixed_prompt_tokens} prompt tokens a step"
             if args.mixed_prompt_tokens else "")
    print(f"\nbatch {args.batch}{mixed}, context {args.input_len}: wall {wall_ms:.3f} ms/step (unprofiled), GPU busy "
          f"{busy:.3f} ms/step, kernel sum {total_us / 1e3 / args.steps:.3f} ms/step, "
          f"{len(kernels) / args.steps:.0f} kernels/step")
    model = loaded.model
    switches = [f"{name.replace('_', ' ')} {'on' if getattr(model.backend, name) else 'off'}"
                for name in ("fused_rope", "fused_merge") if hasattr(model.backend, name)]
    if switches:  # the Triton back end's A/B switches (SITS_DECODE_FUSED_ROPE, SITS_DECODE_FUSED_MERGE)
        print("decode attention: " + ", ".join(switches))
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    shape = loaded.config
    kv_bytes = (2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim
                * engine.runner.kv_shape.dtype.itemsize * args.batch * (args.input_len + 64))
    gpu = detect_gpu(loaded.device) if loaded.device.type == "cuda" else None
    if gpu is not None:
        floor = (weight_bytes + kv_bytes) / gpu.hbm_bytes_per_s * 1e3
        print(f"floor: {weight_bytes / 2**30:.2f} GiB weights + {kv_bytes / 2**30:.2f} GiB KV at "
              f"{gpu.hbm_bytes_per_s / 1e12:.2f} TB/s = {floor:.3f} ms; wall/floor {wall_ms / floor:.2f}")
    _print_kernel_table(by_name, total_us, args.steps)


def _mixed_stepper(engine, prompt_tokens: int, per_step: int, count: int, vocab_size: int):
    """engine.step, or (prompt_tokens > 0) a step that first adds `per_step` fresh prompts of that length, each
    answered with one token (they leave after their prefill, so the decode batch keeps its size): up to `count`
    steps of them."""
    if not prompt_tokens:
        return engine.step
    from sits.runtime.commands import bench
    from sits.runtime.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = iter(bench.random_prompts(count * per_step, prompt_tokens, vocab_size, 11))
    added = iter(range(count * per_step))

    def step():
        for _ in range(per_step):
            engine.add_request(f"mixed-{next(added)}", next(prompts), params)
        return engine.step()

    return step


def _start_decoding(engine, prompts, params) -> None:
    """Add the prompts, step until every one is admitted (a large batch prefills over many steps), then 40
    more steps: the last prefill chunks and the CUDA graphs' warm-up decodes."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"p{index}", prompt, params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(40):
        engine.step()


def _print_kernel_table(by_name: dict[str, list[float]], total_us: float, steps: int) -> None:
    """The 30 kernels with the most GPU time: ms per step, share, calls per step, µs per call."""
    print("\n| kernel | ms/step | share | calls/step | us/call |")
    print("|---|---|---|---|---|")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:30]:
        print(f"| {name[:90]} | {sum(times) / 1e3 / steps:.3f} | {sum(times) / total_us:.1%} | "
              f"{len(times) / steps:.1f} | {sum(times) / len(times):.1f} |")


if __name__ == "__main__":
    sys.exit(main())
