"""The engine process's own cost per token, apart from the machine's load: the step loop served over a pipe
against the offline loop of `sits bench`, one engine, one process, runs interleaved.

`bench_served_vs_offline.py` compares whole processes on a shared CPU, where the throughputs and even the CPU
times swing with whatever else runs. This isolates what the process boundary adds to the engine's side: the
same `LLMEngine` (a small random model, `--config`, default `tiny`) runs B prompts of --input-len tokens to
--output-len tokens (EOS ignored) two ways, alternately, --repeats times:
  - offline: `add_request` x B, then `step()` until done, reading the outputs, as `sits bench` does (with
    detokenization, as there);
  - core: the engine process's `EngineCore` loop (token deltas, encoding, the pipe write, the receiver thread),
    fed over a real pipe by a thread playing the server: one batch of B `AddRequest`s, then it reads and
    unpickles every `CoreBatch` until the B requests finished.
It reports CPU time per output token (user + system of the process, less the server thread's own CPU time),
the engine's context switches (voluntary + involuntary, all its threads) per step, and the ratio core /
offline (median over the repeats). 1 torch thread.

    python benchmarks/bench_engine_core_overhead.py [--config tiny] [--batch 32] [--input-len 128]
        [--output-len 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from multiprocessing import Pipe


def _context_switches() -> int:
    """Voluntary + involuntary context switches of every thread of this process so far."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as status:
                total += sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)
        except OSError:  # the thread ended meanwhile
            continue
    return total


def run_offline(engine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, int, int]:
    """(CPU seconds, steps, context switches) of `sits bench`'s loop."""
    from sits.runtime.engine.request import SamplingParams

    engine.output_processor.detokenize = True
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    switches, cpu = _context_switches(), time.process_time()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
    steps = tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += len(output.outputs[0].token_ids_delta)
        steps += 1
    cpu, switches = time.process_time() - cpu, _context_switches() - switches
    assert tokens == len(prompts) * output_len, tokens
    return cpu, steps, switches


def run_core(engine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, int, int]:
    """(CPU seconds less the server thread's, steps, context switches) of the engine process's loop."""
    from sits.runtime.engine import core_wire as wire
    from sits.runtime.engine.core_process import EngineCore
    from sits.runtime.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    server_end, engine_end = Pipe(duplex=True)
    core = EngineCore(engine, engine_end)
    server_cpu: list[float] = []
    batches = [0]

    def server() -> None:
        begin = time.thread_time()
        server_end.send_bytes(wire.encode([wire.AddRequest(f"{tag}-{index}", prompt, params, "default", 0, None,
                                                           True, None) for index, prompt in enumerate(prompts)]))
        tokens, finished = 0, 0
        while finished < len(prompts):
            batch = wire.decode(server_end.recv_bytes())
            batches[0] += 1
            for _, done, _, completions, _ in batch.outputs:
                tokens += sum(len(completion[1]) for completion in completions)
                finished += done
        server_end.send_bytes(wire.encode([wire.Shutdown(0.0)]))
        while not wire.decode(server_end.recv_bytes()).stopped:
            pass
        assert tokens == len(prompts) * output_len, tokens
        server_cpu.append(time.thread_time() - begin)

    steps_before = engine.stats().num_steps
    thread = threading.Thread(target=server, name="server")
    switches, cpu = _context_switches(), time.process_time()
    thread.start()
    core.run()  # on this thread: it returns once the Shutdown is answered
    thread.join()
    cpu, switches = time.process_time() - cpu, _context_switches() - switches
    server_end.close()
    engine_end.close()
    return cpu - server_cpu[0], engine.stats().num_steps - steps_before, switches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny", help="the random model's shape (sits.runtime.models.presets)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from sits.runtime.commands import bench
    from sits.runtime.engine.engine import LLMEngine

    bench_parser = argparse.ArgumentParser()
    bench.add_bench_arguments(bench_parser)
    bench_args = bench_parser.parse_args(["--config", args.config, "--batch", str(args.batch), "--input-len",
                                          str(args.input_len), "--output-len", str(args.output_len),
                                          "--max-num-seqs", str(args.batch), "--peer", "none"])
    config = bench.build_config(bench_args)
    loaded = bench.load(bench_args, config)
    engine = LLMEngine.from_loaded(loaded, config)
    vocab = loaded.config.vocab_size
    tokens = args.batch * args.output_len
    run_offline(engine, bench.random_prompts(args.batch, args.input_len, vocab, 1), 4, "warmup")
    rows: dict[str, list[tuple[float, int, int]]] = {"offline": [], "core": []}
    for repeat in range(args.repeats):
        for name, run in (("offline", run_offline), ("core", run_core)) if repeat % 2 == 0 else (
                ("core", run_core), ("offline", run_offline)):
            prompts = bench.random_prompts(args.batch, args.input_len, vocab, 100 + 2 * repeat + (name == "core"))
            rows[name].append(run(engine, prompts, args.output_len, f"{name}-{repeat}"))  # no prefix shared
    load = os.getloadavg()
    print(f"\nengine core loop vs offline loop: random {args.config} weights, batch {args.batch}, {args.input_len} in / "
          f"{args.output_len} out, {args.repeats} runs each, load average {load[0]:.1f} at the end")
    print(f"{'loop':>8} {'CPU ms/token (runs)':>44} {'median':>8} {'steps':>6} {'switches/step':>14}")
    medians = {}
    for name, results in rows.items():
        per_token = [1e3 * cpu / tokens for cpu, _, _ in results]
        medians[name] = statistics.median(per_token)
        switches = statistics.median(s / steps for _, steps, s in results)
        print(f"{name:>8} {' '.join(f'{v:.4f}' for v in per_token):>44} {medians[name]:8.4f} "
              f"{statistics.median(steps for _, steps, _ in results):6.0f} {switches:14.2f}")
    ratios = [core[0] / offline[0] for core, offline in zip(rows["core"], rows["offline"], strict=True)]
    print(f"core / offline CPU per token: median {statistics.median(ratios):.3f} (runs: "
          f"{' '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
