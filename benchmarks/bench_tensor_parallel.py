"""Tensor parallelism: one replica over N GPUs against the same model on one GPU, same run, same workload.

The workload is the end-to-end one of BASELINES.md: a Llama-3-8B-shaped model with random bf16
weights, batch 32, 2,048 prompt tokens and 512 output tokens per sequence, greedy. Each size in
--tp-sizes runs it through the engine's model runner (rank 0's `TensorParallelModelRunner` with its
spawned workers for N > 1, the plain `ModelRunner` for 1): prefill steps of at most
--max-num-batched-tokens tokens as the scheduler builds them, then batched decode steps. The figure
is output tokens per second and the mean decode step; each larger size is printed as a ratio to TP=1.

    python benchmarks/bench_tensor_parallel.py                       # 2 GPUs: TP=1 then TP=2
    python benchmarks/bench_tensor_parallel.py --preset tiny --device cpu --batch 2 \
        --prompt-len 16 --output-len 8 --tp-sizes 1,2               # a CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from dataclasses import asdict, dataclass

import torch

from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.runner import ModelRunner
from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from sits.runtime.engine.sequence import Sequence
from sits.runtime.models.presets import PRESETS, preset_config
from sits.runtime.parallel.config import ParallelConfig
from sits.runtime.parallel.executor import TensorParallelExecutor
from sits.runtime.parallel.recipe import ModelRecipe


@dataclass
class Result:
    tp: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    output_tokens: int

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s

    @property
    def decode_step_ms(self) -> float:
        return 1000 * self.decode_s / max(1, self.decode_steps)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_steps(seqs: list[Sequence], tables: list[list[int]], budget: int) -> list[list[ScheduledSequence]]:
    """Prompts packed into steps of at most `budget` new tokens, long prompts chunked (the scheduler's shape)."""
    steps, current, used = [], [], 0
    for seq, table in zip(seqs, tables, strict=True):
        start = 0
        while start < len(seq.prompt_token_ids):
            take = min(budget - used, len(seq.prompt_token_ids) - start)
            end = start + take
            current.append(ScheduledSequence(seq, seq.prompt_token_ids[start:end], start, table,
                                             samples=end == len(seq.prompt_token_ids)))
            used += take
            start = end
            if used == budget:
                steps.append(current)
                current, used = [], 0
    if current:
        steps.append(current)
    return steps


def run_workload(runner: ModelRunner, args: argparse.Namespace, vocab_size: int, tp: int) -> Result:
    block_size = runner.block_size
    per_seq = -(-(args.prompt_len + args.output_len) // block_size)
    runner.allocate_kv_cache(args.batch * per_seq)
    generator = torch.Generator().manual_seed(0)
    seqs = [Sequence(seq_id=f"s{i}", request_id=f"s{i}", index=0,
                     prompt_token_ids=torch.randint(vocab_size, (args.prompt_len,), generator=generator).tolist(),
                     params=SamplingParams(temperature=0.0), max_tokens=args.output_len, arrival_time=0.0)
            for i in range(args.batch)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(args.batch)]

    _sync(runner.device)
    started = time.perf_counter()
    for step in prefill_steps(seqs, tables, args.max_num_batched_tokens):
        sampled = runner.execute(SchedulerOutput(scheduled=step)).sampled
        for seq_id, token in sampled.items():
            next(s for s in seqs if s.seq_id == seq_id).append_output_token(token.token_id)
    _sync(runner.device)
    prefill_s = time.perf_counter() - started

    started = time.perf_counter()
    steps = 0
    while len(seqs[0].output_token_ids) < args.output_len:
        step = [ScheduledSequence(s, [s.all_token_ids[-1]], s.num_tokens - 1, t, samples=True)
                for s, t in zip(seqs, tables, strict=True)]
        sampled = runner.execute(SchedulerOutput(scheduled=step)).sampled
        for seq in seqs:
            seq.append_output_token(sampled[seq.seq_id].token_id)
        steps += 1
    _sync(runner.device)
    return Result(tp, prefill_s, time.perf_counter() - started, steps, args.batch * args.output_len)


def warmed_run(runner: ModelRunner, args: argparse.Namespace, vocab_size: int, tp: int) -> Result:
    """A short untimed pass first (kernel compilation, allocator, NCCL warm-up), then the measured one."""
    warmup = argparse.Namespace(**{**vars(args), "batch": min(2, args.batch), "prompt_len": min(32, args.prompt_len),
                                   "output_len": min(4, args.output_len)})
    run_workload(runner, warmup, vocab_size, tp)
    return run_workload(runner, args, vocab_size, tp)


def measure(tp: int, args: argparse.Namespace) -> Result:
    config = preset_config(args.preset)
    recipe = ModelRecipe.random(config, seed=0, device=args.device, dtype=args.dtype,
                                attention_backend=args.attention_backend,
                                max_model_len=args.prompt_len + args.output_len)
    if tp == 1:
        device = torch.device("cuda", 0) if recipe.device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        loaded = recipe.load(device)
        runner = ModelRunner(loaded.model, device, loaded.dtype, args.block_size, Sampler((), device))
        result = warmed_run(runner, args, config.vocab_size, tp)
        del runner, loaded
    else:
        executor = TensorParallelExecutor.start(recipe, ParallelConfig(tensor_parallel_size=tp), progress=False)
        try:
            loaded = executor.loaded
            runner = executor.make_runner(loaded.model, loaded.device, loaded.dtype, args.block_size,
                                          Sampler((), loaded.device))
            result = warmed_run(runner, args, config.vocab_size, tp)
            del runner, loaded
        finally:
            executor.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3-8b")
    parser.add_argument("--tp-sizes", default="1,2", help="comma-separated; 1 is the peer every size is compared to")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sizes = [int(size) for size in args.tp_sizes.split(",")]
    results = [measure(tp, args) for tp in sizes]

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else "CPU"
    print(f"\ntensor parallel, {args.preset} shape, random weights ({args.dtype}), {device}; batch {args.batch}, "
          f"{args.prompt_len} prompt + {args.output_len} output tokens, greedy")
    peer = next((r for r in results if r.tp == 1), results[0])
    for r in results:
        print(f"TP={r.tp}: prefill {r.prefill_s:7.2f} s, decode {r.decode_s:7.2f} s ({r.decode_step_ms:6.2f} ms/step), "
              f"total {r.total_s:7.2f} s, {r.output_tokens_per_s:8.1f} output tok/s; vs TP={peer.tp}: "
              f"{r.output_tokens_per_s / peer.output_tokens_per_s:4.2f}x tok/s, "
              f"{r.decode_step_ms / peer.decode_step_ms:4.2f}x decode step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "output_tokens_per_s": r.output_tokens_per_s} for r in results], f, indent=2)


if __name__ == "__main__":
    main()
