"""The decode latency budget on a modelled H200: the real scheduler, a step-time model, served against offline.

    python benchmarks/sim_decode_budget.py --budgets 0,512,768,1024,2048 [--min-decodes 64] [--batch 256]
        [--input-len 1024] [--output-len 512] [--prompts 1024] [--json sim.json]

What the H200 runs of `benchmarks/gpu_serving_run.sh` showed (benchmarks/RESULTS.md, 2026-12-02): at 256 streams
the served figures swing from run to run, and the prompt-token cap beside decodes
(`--max-prefill-tokens-with-decodes`) trades output tok/s against the ITL tail. Device time is short, so this
tool ranks cap settings on the CPU first. The engine is the real one (scheduler, KV cache, chunked prefill, the
cap) on a tiny random model; only the clock is modelled: each step advances a virtual clock by what that step's
composition would take on one H200 with the Llama-3-8B shape in bf16 (`StepCost`, fitted to the measured steps):

    ms = fixed + per_decode * decodes + kv_ms_per_mtoken * (context tokens the decodes read) / 1e6
         + per_prompt_token * prompt tokens + (mixed_fixed if prompt tokens beside decodes)

For each cap it runs the two `gpu_serving_run.sh` compares in virtual time: offline (`--batch` prompts at once,
one wave, as `sits bench`) and served (`--prompts` through a closed loop of `--batch` in flight, as
`sits bench serve --max-concurrency`: a finished request is replaced at once). Printed per cap: modelled output
tok/s both ways and their ratio, served ITL p50 / p99 and p99 / p50, TTFT p50 / p99, and the share of gaps of
50 ms or more. The model has no host time, no run-to-run noise and no async overlap: it ranks settings, it does
not replace the GPU run. Token ids are random, so nothing here depends on the model's outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sits.runtime.commands.bench_serve_metrics import percentile
from sits.runtime.engine.step_trace import StepComposition

GAP_TAIL_MS = 50.0
H200_KV_BLOCKS = 55_654  # 108.7 GiB for the KV cache / (16 tokens x 128 KiB), the bf16 runs' start-up line


@dataclass(frozen=True)
class StepCost:
    """Milliseconds of one step on an H200, Llama-3-8B shape, bf16 (benchmarks/RESULTS.md, 2026-12-02):
    batch 1 at 2,048 tokens of context 4.4 ms; batch 32 at 2,048 6.7 ms; 256 decodes at ~1,280 17.3 ms;
    a step of 8,192 prompt tokens beside 256 decodes ~200 ms (22.6 us a prompt token). KV: 128 KiB a token
    read at ~4.0 TB/s (32.8 ms per million tokens). mixed_fixed_ms: what a step with prompt tokens beside
    decodes took beyond that in the served 256-stream runs (estimated from their durations: 10-21 ms; 0 gives
    the plain model)."""

    fixed_ms: float = 4.35
    per_decode_ms: float = 0.008
    kv_ms_per_mtoken: float = 32.8
    per_prompt_token_ms: float = 0.0226
    mixed_fixed_ms: float = 15.0

    def ms(self, decodes: int, context_tokens: int, prompt_tokens: int) -> float:
        mixed = self.mixed_fixed_ms if decodes and prompt_tokens else 0.0
        return (self.fixed_ms + self.per_decode_ms * decodes + self.kv_ms_per_mtoken * context_tokens / 1e6
                + self.per_prompt_token_ms * prompt_tokens + mixed)


@dataclass
class Run:
    """One closed loop in virtual time: output tok/s, per-token gaps and TTFTs (ms), steps."""

    output_tok_s: float
    itl_ms: list[float]
    ttft_ms: list[float]
    steps: int


def run_virtual(engine, compositions: list[StepComposition], prompts: list[list[int]], output_len: int,
                concurrency: int, cost: StepCost) -> Run:
    """Every prompt through the engine with at most `concurrency` in flight; the clock advances by each
    step's modelled time, and each token is stamped at the end of the step that made it. `compositions`: the
    list the engine's step_observer appends each step's StepComposition to."""
    from sits.runtime.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    del compositions[:]
    stamps: dict[str, list[float]] = {}
    sent: dict[str, float] = {}
    queue = list(enumerate(prompts))[::-1]
    clock = 0.0
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < concurrency:
            index, prompt = queue.pop()
            sent[f"sim-{index}"] = clock
            engine.add_request(f"sim-{index}", prompt, params)
        before = len(compositions)
        outputs = engine.step()
        for step in compositions[before:]:
            clock += cost.ms(step.decodes, step.context_tokens, step.prompt_tokens)
        for output in outputs:
            stamps.setdefault(output.request_id, []).extend([clock] * len(output.outputs[0].token_ids_delta))
    tokens = sum(len(s) for s in stamps.values())
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False)]
    ttfts = [s[0] - sent[request_id] for request_id, s in stamps.items() if s]
    return Run(1000.0 * tokens / max(clock, 1e-9), gaps, ttfts, len(compositions))


def compare(offline: Run, served: Run) -> dict:
    """The figures of one cap: gpu_serving_run.sh's summary line, in modelled time."""
    p50, p99 = percentile(served.itl_ms, 50), percentile(served.itl_ms, 99)
    tail = sum(g >= GAP_TAIL_MS for g in served.itl_ms) / max(len(served.itl_ms), 1)
    return {"offline_tok_s": offline.output_tok_s, "served_tok_s": served.output_tok_s,
            "ratio": served.output_tok_s / offline.output_tok_s, "itl_p50_ms": p50, "itl_p99_ms": p99,
            "itl_p99_over_p50": p99 / p50, "ttft_p50_ms": percentile(served.ttft_ms, 50),
            "ttft_p99_ms": percentile(served.ttft_ms, 99), "gaps_over_50ms": tail,
            "offline_steps": offline.steps, "served_steps": served.steps}


def _appender(steps: list[StepComposition]):
    """A step_observer that appends each scheduled step's composition to `steps`."""
    return lambda output: steps.append(StepComposition.of(output))


def simulate_cap(args: argparse.Namespace, cap: int, cost: StepCost) -> dict:
    """Offline and served runs with one cap, each on an engine of its own (same seed, same prompts)."""
    from sits.runtime.commands import bench
    from sits.runtime.engine.engine import LLMEngine

    runs = []
    for count in (args.batch, args.prompts):
        args.max_prefill_tokens_with_decodes = cap
        config = bench.build_config(args)
        loaded = bench.load(args, config)
        steps: list[StepComposition] = []
        engine = LLMEngine.from_loaded(loaded, config, step_observer=_appender(steps))
        prompts = bench.random_prompts(count, args.input_len, loaded.config.vocab_size, 1)
        runs.append(run_virtual(engine, steps, prompts, args.output_len, args.batch, cost))
    return {"cap": cap, "min_decodes": args.prefill_cap_min_decodes, **compare(*runs)}


def print_table(rows: list[dict], header: bool = True) -> None:
    if header:
        print("| cap (prompt tokens beside M+ decodes) | offline tok/s | served tok/s | ratio | served ITL p50 / p99 "
              "ms (p99/p50) | gaps >= 50 ms | TTFT p50 / p99 ms |")
        print("|---|---|---|---|---|---|---|")
    for r in rows:
        cap = "none" if r["cap"] == 0 else f"{r['cap']} (M = {r['min_decodes']})"
        print(f"| {cap} | {r['offline_tok_s']:,.0f} | {r['served_tok_s']:,.0f} | {r['ratio']:.3f}x | "
              f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} ({r['itl_p99_over_p50']:.2f}) | "
              f"{r['gaps_over_50ms']:.1%} | {r['ttft_p50_ms']:,.0f} / {r['ttft_p99_ms']:,.0f} |", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from sits.runtime.commands import bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_bench_arguments(parser)
    parser.add_argument("--prompts", type=int, default=None, help="served prompts in all (default: 4 x --batch)")
    parser.add_argument("--budgets", default="0,512,768,1024,2048",
                        help="comma-separated caps to compare (0: no cap)")
    parser.add_argument("--min-decodes", type=int, default=64, help="the cap applies beside this many decodes")
    parser.add_argument("--mixed-fixed-ms", type=float, default=StepCost.mixed_fixed_ms,
                        help="ms a step with prompt tokens beside decodes costs beyond the linear model")
    # The H200's engine limits (runtime/hardware.py) and KV blocks (108.7 GiB of bf16 Llama-3-8B KV, 16-token
    # blocks), on a tiny random model on the CPU; later flags override these.
    defaults = ["--config", "tiny", "--device", "cpu", "--batch", "256", "--input-len", "1024", "--output-len",
                "512", "--peer", "none", "--log-level", "warning", "--max-num-batched-tokens", "8192",
                "--num-blocks", str(H200_KV_BLOCKS), "--no-async-scheduling"]
    args = parser.parse_args([*defaults, *(argv if argv is not None else sys.argv[1:])])
    args.prompts = args.prompts or 4 * args.batch
    args.prefill_cap_min_decodes = args.min_decodes
    args.max_num_seqs = args.batch
    try:
        args.budget_list = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        parser.error(f"--budgets: {args.budgets!r} is not a comma-separated list of integers")
    if any(b < 0 for b in args.budget_list):
        parser.error("--budgets: a cap is 0 (none) or a positive number of prompt tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    from sits.runtime.commands.engine_args import configure_logging

    args = parse_args(argv)
    configure_logging(args.log_level)
    cost = StepCost(mixed_fixed_ms=args.mixed_fixed_ms)
    print(f"modelled H200 step: {cost}; {args.batch} in flight, {args.input_len} / {args.output_len}, "
          f"{args.prompts} served prompts, engine shape {args.config} on {args.device}", flush=True)
    rows = []
    for cap in args.budget_list:
        rows.append(simulate_cap(args, cap, cost))
        print_table(rows[-1:], header=len(rows) == 1)
    if args.json:
        Path(args.json).write_text(json.dumps({"cost": asdict(cost), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
