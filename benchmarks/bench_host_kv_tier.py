"""The host KV tier (--host-kv-cache-gb) on a many-tenant long-prefix workload: tier off vs on, one run.

Workload: `tenants` tenants, each with its own long prefix (a system prompt or document of
`prefix_tokens` random token ids) and its own prefix-cache salt, so nothing is shared across
tenants. Phase 0 (kernel warm-up, not measured): one extra prefix of the same length, sent twice, so
every kernel the follow-ups use is compiled and tuned first (a first prefill over a cached prefix
otherwise pays Triton's autotuning inside a timed request). Phase 1 (warm): every tenant sends one request (prefix + a question). Phase 2 (follow-ups):
every tenant sends `followups` more requests (prefix + a new question) in a seeded random order,
`concurrency` requests in flight at a time (closed loop). The GPU cache holds about 1/`oversubscribe`
of all prefixes (`--num-blocks`, by default total prefix blocks / 4), so without the tier most
follow-ups recompute their whole prefix; with it, their prefix comes back from host memory.

Figures for the follow-up phase, per mode: TTFT p50 / p99 (from add_request to the first token on
the host), output tokens/s (generated tokens / the phase's wall time) and the hit rate of each
tier (prompt tokens served from the GPU cache or the host tier / prompt tokens looked up), plus
the host tier's offload / onload GiB and copy seconds.

The model is a preset shape with seeded random weights (`--config llama-3-8b`: the real 8B shape
and compute), loaded once and shared by both engines; each mode builds a fresh engine.

On one H200 (what the issue's target is measured with; 64 x 8k tokens of bf16 KV = 64 GiB):

    python benchmarks/bench_host_kv_tier.py --config llama-3-8b --device cuda --dtype bfloat16 \
        --tenants 64 --prefix-tokens 8192 --json /tmp/host_tier.json

64 x 16k-token prefixes need 128 GiB of host tier plus the process: a host with more than ~160 GiB of
RAM (`--prefix-tokens 16384 --host-kv-cache-gb 136`). A CPU check of the logic at a tiny size:

    python benchmarks/bench_host_kv_tier.py --config tiny --device cpu --dtype float32 --tenants 8 \
        --prefix-tokens 96 --question-tokens 8 --output-tokens 4 --concurrency 2 --oversubscribe 3
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from sits.runtime.attention.registry import select_backend
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.cache_sizing import GIB, KVShape
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import SamplingParams
from sits.runtime.models.loading import LoadedModel
from sits.runtime.models.presets import preset_config
from sits.runtime.models.random_model import random_loaded_model

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    # Import the `benchmarks` package from the repository root, then take the root off sys.path again:
    # its `operator/` and `kernels/` folders must not shadow the standard library's and others' modules.
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from benchmarks.run_report import print_report  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass
class ModeResult:
    """One mode's follow-up phase (seconds, tokens/s, fractions 0..1, GiB)."""

    mode: str
    host_kv_cache_gb: float
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    output_tok_s: float
    wall_s: float
    gpu_hit_rate: float
    host_hit_rate: float
    offload_gib: float = 0.0
    onload_gib: float = 0.0
    offload_s: float = 0.0
    onload_s: float = 0.0
    dropped_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class Workload:
    prefixes: list[list[int]]  # per tenant
    warm: list[tuple[int, list[int]]]  # (tenant, prompt)
    followups: list[tuple[int, list[int]]]
    output_tokens: int
    kernel_warmup: list[tuple[int, list[int]]]  # one extra tenant's prefix, twice (not measured)


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    prefixes = [tokens(args.prefix_tokens) for _ in range(args.tenants)]
    warm = [(t, prefixes[t] + tokens(args.question_tokens)) for t in range(args.tenants)]
    followups = [(t, prefixes[t] + tokens(args.question_tokens)) for _ in range(args.followups)
                 for t in range(args.tenants)]
    rng.shuffle(followups)
    extra = tokens(args.prefix_tokens)
    kernel_warmup = [(args.tenants, extra + tokens(args.question_tokens)) for _ in range(2)]
    return Workload(prefixes, warm, followups, args.output_tokens, kernel_warmup)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_closed_loop(engine: LLMEngine, requests: list[tuple[int, list[int]]], concurrency: int,
                    output_tokens: int, tag: str) -> tuple[list[float], int, float]:
    """Run `requests` with `concurrency` in flight; returns (TTFTs in s, generated tokens, wall s)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    pending = list(enumerate(requests))
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    generated = 0
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            index, (tenant, prompt) = pending.pop(0)
            request_id = f"{tag}-{index}"
            engine.add_request(request_id, prompt, params, tenant=f"t{tenant}", cache_salt=f"salt-{tenant}")
            added[request_id] = time.perf_counter()
            in_flight += 1
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.request_id not in ttft and output.outputs and output.outputs[0].token_ids:
                ttft[output.request_id] = now - added[output.request_id]
            if output.finished:
                generated += len(output.outputs[0].token_ids)
                in_flight -= 1
    wall = time.perf_counter() - start
    if len(ttft) != len(requests):
        raise RuntimeError(f"{len(requests) - len(ttft)} requests never produced a token")
    return list(ttft.values()), generated, wall


def run_mode(loaded: LoadedModel, args: argparse.Namespace, workload: Workload, num_blocks: int,
             host_gb: float, max_model_len: int) -> ModeResult:
    config = EngineConfig(
        model=ModelConfig(device=args.device, dtype=args.dtype, max_model_len=max_model_len),
        cache=CacheConfig(block_size=args.block_size, num_blocks=num_blocks, host_kv_cache_gb=host_gb),
        scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency, 1),
                                  max_num_batched_tokens=args.max_num_batched_tokens),
        enforce_eager=args.enforce_eager)
    engine = LLMEngine.from_loaded(loaded, config)
    mode = "host tier on" if host_gb > 0 else "host tier off"
    try:
        # Compile and tune every kernel the follow-ups use (a prefill over a cached prefix included)
        # before anything is timed: one prefix of the same length, sent twice, with its own salt.
        run_closed_loop(engine, workload.kernel_warmup, 1, workload.output_tokens, "kernel-warmup")
        run_closed_loop(engine, workload.warm, args.concurrency, workload.output_tokens, "warm")
        before = engine.stats()
        ttfts, generated, wall = run_closed_loop(engine, workload.followups, args.concurrency,
                                                 workload.output_tokens, "followup")
        if engine.runner.host_tier is not None:
            engine.runner.host_tier.synchronize()
        after = engine.stats()
    finally:
        engine.shutdown()
    queries = max(after.prefix_cache_queries - before.prefix_cache_queries, 1)
    host_hits = after.prefix_cache_host_hits - before.prefix_cache_host_hits
    gpu_hits = after.prefix_cache_hits - before.prefix_cache_hits - host_hits
    result = ModeResult(mode, host_gb, len(ttfts), statistics.median(ttfts), percentile(ttfts, 0.99),
                        generated / wall, wall, gpu_hits / queries, host_hits / queries)
    if after.host_kv is not None:
        result.offload_gib = after.host_kv.offload_bytes / GIB
        result.onload_gib = after.host_kv.onload_bytes / GIB
        result.offload_s = after.host_kv.offload_seconds
        result.onload_s = after.host_kv.onload_seconds
        result.dropped_blocks = after.host_kv.dropped_blocks
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def print_table(results: list[ModeResult]) -> None:
    print("| mode | host GiB | follow-ups | TTFT p50 ms | TTFT p99 ms | output tok/s | GPU hit | host hit "
          "| onload GiB (s) | offload GiB (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.mode} | {r.host_kv_cache_gb:.3g} | {r.requests} | {r.ttft_p50_s * 1e3:,.1f} | "
              f"{r.ttft_p99_s * 1e3:,.1f} | {r.output_tok_s:,.1f} | {r.gpu_hit_rate:.1%} | {r.host_hit_rate:.1%} | "
              f"{r.onload_gib:.2f} ({r.onload_s:.2f}) | {r.offload_gib:.2f} ({r.offload_s:.2f}) |")
    off = next((r for r in results if r.host_kv_cache_gb == 0), None)
    on = next((r for r in results if r.host_kv_cache_gb > 0), None)
    if off is not None and on is not None:
        print(f"\nTTFT p50 off/on: {off.ttft_p50_s / on.ttft_p50_s:.2f}x lower with the tier; "
              f"output tok/s on/off: {on.output_tok_s / off.output_tok_s:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama-3-8b", help="model shape preset (random weights)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=8192, help="each tenant's shared prefix")
    parser.add_argument("--question-tokens", type=int, default=128, help="each request's own suffix")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--followups", type=int, default=1, help="follow-up requests per tenant")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (closed loop)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--oversubscribe", type=float, default=4.0,
                        help="all prefixes / what the GPU cache holds (sets --num-blocks when not given)")
    parser.add_argument("--num-blocks", type=int, default=None, help="GPU KV blocks (default: from --oversubscribe)")
    parser.add_argument("--host-kv-cache-gb", type=float, default=None,
                        help="the tier's size when on (default: every prefix + 12%%)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--modes", default="off,on", help="comma-separated: off, on (same run, same model)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)

    shape = preset_config(args.config)
    dtype = DTYPES[args.dtype]
    kv = KVShape(shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim, dtype)
    per_block = kv.bytes_per_block(args.block_size)
    prefix_blocks = -(-args.prefix_tokens // args.block_size)
    max_model_len = args.prefix_tokens + args.question_tokens + args.output_tokens + args.block_size
    seq_blocks = -(-max_model_len // args.block_size)
    num_blocks = args.num_blocks or int(args.tenants * prefix_blocks / args.oversubscribe)
    if num_blocks < args.concurrency * seq_blocks:
        parser.error(f"{num_blocks} GPU blocks cannot hold {args.concurrency} running requests of {seq_blocks} "
                     "blocks: lower --concurrency or --oversubscribe")
    host_gb = args.host_kv_cache_gb or args.tenants * prefix_blocks * per_block * 1.12 / GIB
    device = torch.device(args.device)
    backend = select_backend("auto", device, dtype, shape.head_dim)
    loaded = random_loaded_model(shape, backend, device, dtype, seed=args.seed,
                                 max_positions=max(shape.max_position_embeddings, max_model_len), name=args.config)
    workload = make_workload(args, shape.vocab_size)
    print(f"{args.config} ({args.dtype}, random weights) on {device}: {args.tenants} tenants x {args.prefix_tokens}-token "
          f"prefixes = {args.tenants * prefix_blocks * per_block / GIB:.1f} GiB of KV; GPU cache {num_blocks} blocks "
          f"({num_blocks * per_block / GIB:.1f} GiB, {num_blocks / (args.tenants * prefix_blocks):.0%} of the prefixes); "
          f"host tier {host_gb:.1f} GiB when on", file=sys.stderr)
    results = []
    for mode in args.modes.split(","):
        gb = {"off": 0.0, "on": host_gb}[mode.strip()]
        results.append(run_mode(loaded, args, workload, num_blocks, gb, max_model_len))
        print(f"{results[-1].mode}: done in {results[-1].wall_s:.1f} s", file=sys.stderr)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print_report(f"host KV tier, follow-up phase: {args.config} {args.dtype} on {device_name}, {args.tenants} "
                 f"tenants x {args.prefix_tokens} + {args.question_tokens} prompt tokens, {args.output_tokens} output "
                 f"tokens, concurrency {args.concurrency}, torch {torch.__version__}", print_table, results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
