"""Multi-LoRA serving cost on a CPU: the engine with adapters against the same engine without, same run.

SmolLM2-135M-Instruct, float32, the torch back end. Each scenario runs one batch of --batch
greedy requests (--max-tokens output tokens each, EOS ignored) through LLMEngine from the first
step to the last, prefill included, and reports output tokens per second. The peer is the
engine without LoRA on the same prompts: what a single adapter merged into the weights costs,
the floor any LoRA server is measured against. Scenarios and peer alternate over --repeats
rounds (median kept), so other work on the machine slows all of them alike.

Adapters are random PEFT adapters on every projection (q, k, v, o, gate, up, down), rank --rank.
The last row runs the 4-adapter batch with the adapters applied one group of rows at a time (the
path of large steps) instead of all slots at once under a mask (small steps' path, the default).

    PYTHONSAFEPATH=1 python benchmarks/bench_lora_cpu.py [--batch 8] [--max-tokens 32] [--rank 16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    # Import the repository's packages from its root, then take the root off sys.path again:
    # its `operator/` and `kernels/` folders must not shadow the standard library's and others' modules.
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    import tests.runtime.lora_helpers  # noqa: F401  (the PEFT adapter writer the tests use)
    sys.path.remove(_root)

from sits.runtime.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from sits.runtime.engine.engine import LLMEngine  # noqa: E402
from sits.runtime.engine.request import SamplingParams  # noqa: E402
from sits.runtime.lora.config import LoraConfig, LoraModule  # noqa: E402
from sits.runtime.lora.layers import DENSE_MAX_TOKENS  # noqa: E402
from sits.runtime.models.loading import load_model  # noqa: E402
from tests.runtime.lora_helpers import write_peft_adapter  # noqa: E402

PROMPTS = ["The three primary colors are", "Once upon a time, in a small village,", "The capital of France is",
           "A recipe for pancakes:", "Why is the sky blue?", "Photosynthesis is the process", "def fibonacci(n):",
           "The largest ocean on Earth"]
ADAPTERS = ("a1", "a2", "a3", "a4")
PER_ADAPTER = "4 adapters, mixed, per-adapter loop"


def engine_config(lora: LoraConfig | None, batch: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=512),
                        cache=CacheConfig(block_size=16, num_blocks=max(64, batch * 8)),
                        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=2048),
                        lora=lora or LoraConfig())


def run_batch(engine: LLMEngine, adapters: list[str | None], max_tokens: int) -> tuple[int, float]:
    """(output tokens, seconds) of one batch: request i runs with adapters[i] (None: the base model)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, adapter in enumerate(adapters):
        prompt = engine.tokenizer.encode(PROMPTS[index % len(PROMPTS)])
        engine.add_request(f"r{index}-{time.monotonic_ns()}", prompt, params, lora=adapter)
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    def load():
        return load_model(ModelConfig(model=None, device="cpu", dtype="float32"), TorchAttentionBackend(),
                          progress=False)

    with tempfile.TemporaryDirectory() as folder:
        plain_model, lora_model = load(), load()  # hooks go on the second only
        modules = [LoraModule(name, str(write_peft_adapter(Path(folder) / name, lora_model.config, rank=args.rank,
                                                            alpha=2 * args.rank, seed=seed)))
                   for seed, name in enumerate(ADAPTERS)]
        lora = LoraConfig(enable_lora=True, modules=modules, max_lora_rank=args.rank)
        plain = LLMEngine.from_loaded(plain_model, engine_config(None, args.batch))
        with_lora = LLMEngine.from_loaded(lora_model, engine_config(lora, args.batch))
        batch = args.batch
        scenarios = {
            "LoRA on, base model rows only": [None] * batch,
            "1 adapter, every row": ["a1"] * batch,
            "base + 2 adapters, mixed": [(None, "a1", "a2")[i % 3] for i in range(batch)],
            "4 adapters, mixed": [ADAPTERS[i % 4] for i in range(batch)],
        }
        run_batch(plain, [None] * batch, 4)  # warm-up of both engines
        run_batch(with_lora, scenarios["4 adapters, mixed"], 4)
        rates: dict[str, list[float]] = {name: [] for name in ["no LoRA (peer)", *scenarios, PER_ADAPTER]}
        for _ in range(args.repeats):
            tokens, seconds = run_batch(plain, [None] * batch, args.max_tokens)
            rates["no LoRA (peer)"].append(tokens / seconds)
            for name, adapters in scenarios.items():
                tokens, seconds = run_batch(with_lora, adapters, args.max_tokens)
                rates[name].append(tokens / seconds)
            # the same mixed batch with every step applying the adapters group by group
            with_lora.lora.step.dense_max_tokens = 0
            tokens, seconds = run_batch(with_lora, scenarios["4 adapters, mixed"], args.max_tokens)
            rates[PER_ADAPTER].append(tokens / seconds)
            with_lora.lora.step.dense_max_tokens = DENSE_MAX_TOKENS
        plain.shutdown()
        with_lora.shutdown()

    print(f"# LoRA on CPU: SmolLM2-135M float32, {platform.processor() or platform.machine()}, "
          f"{args.threads} threads, batch {batch} x {args.max_tokens} tokens, rank {args.rank}, "
          f"median of {args.repeats}")
    peer = statistics.median(rates["no LoRA (peer)"])
    print(f"{'scenario':38s} {'tok/s':>8s} {'vs no LoRA':>11s}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:38s} {rate:8.1f} {rate / peer:10.2f}x")


if __name__ == "__main__":
    main()
