"""N-gram speculative decoding on a CPU: the engine with `--speculative-config` against the same engine without.

SmolLM2-135M-Instruct, float32, the torch back end, through `LLMEngine` from the first step to the last
(prefill included). Two workloads of --batch greedy requests x --max-tokens output tokens (EOS ignored):
  * repetitive: chat prompts asking to copy code back with one change (the answer mostly repeats the prompt,
    where prompt lookup finds its drafts);
  * open: ordinary questions (few n-gram matches: what speculation costs when it rarely applies).
The peer is the engine without speculation on the same prompts in the same run; each pair alternates over
--repeats rounds (median kept) so other work on the machine slows both alike. Outputs are checked to be
token-identical (greedy), and the acceptance rate (accepted / proposed drafts) is printed.

    PYTHONSAFEPATH=1 python benchmarks/bench_speculative_cpu.py [--batch 4] [--max-tokens 96] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    # Import the repository's packages from its root, then take the root off sys.path again:
    # its `operator/` and `kernels/` folders must not shadow the standard library's and others' modules.
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from sits.runtime.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from sits.runtime.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from sits.runtime.engine.engine import LLMEngine  # noqa: E402
from sits.runtime.engine.request import SamplingParams  # noqa: E402
from sits.runtime.models.loading import load_model  # noqa: E402

CODE = [
    "def area(width, height):\n    result = width * height\n    print('area', result)\n    return result\n",
    "for item in items:\n    if item.price > 10:\n        cheap.append(item)\n    else:\n        dear.append(item)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
    "total = 0\nfor line in open('data.txt'):\n    value = int(line.strip())\n    total += value\nprint(total)\n",
]
CHANGES = ["rename result to product", "swap the two branches", "rename norm to length", "rename total to acc"]
QUESTIONS = ["Why is the sky blue?", "Give me three tips for learning to cook.", "How do airplanes fly?",
             "Describe a walk in an autumn forest."]


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                          add_generation_prompt=True))


def run(loaded, spec: SpeculativeConfig | None, prompts: list[list[int]], max_tokens: int):
    """(seconds, output token ids per request, speculation counts) of one batch run to the end."""
    config = EngineConfig(model=ModelConfig(device="cpu", max_model_len=1024), cache=CacheConfig(num_blocks=512),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024), speculative=spec)
    engine = LLMEngine.from_loaded(loaded, config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0].token_ids
    seconds = time.perf_counter() - start
    return seconds, [finals[str(i)] for i in range(len(prompts))], engine.stats().spec_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                          '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    args = parser.parse_args()
    spec = SpeculativeConfig.from_json(args.spec)
    loaded = load_model(ModelConfig(model=None, device="cpu", dtype="float32"), TorchAttentionBackend(), progress=False)
    tokenizer = loaded.tokenizer
    workloads = {
        "repetitive (copy code with one change)": [
            chat(tokenizer, f"Rewrite this Python code and {CHANGES[i % 4]}; keep everything else:\n\n{CODE[i % 4]}")
            for i in range(args.batch)],
        "open questions": [chat(tokenizer, QUESTIONS[i % 4]) for i in range(args.batch)],
    }
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}; speculation: {spec.describe()}")
    print(f"{args.batch} greedy requests x {args.max_tokens} tokens per run, median of {args.repeats} alternating rounds")
    print("| workload | plain tok/s | speculative tok/s | ratio | acceptance (accepted/proposed) | accepted drafts per output token | identical |")
    print("|---|---|---|---|---|---|---|")
    run(loaded, None, workloads["open questions"][:1], 4)  # warm up
    for name, prompts in workloads.items():
        plain_s, spec_s, identical, counts = [], [], True, None
        for _ in range(args.repeats):
            seconds, plain_out, _ = run(loaded, None, prompts, args.max_tokens)
            plain_s.append(seconds)
            seconds, spec_out, counts = run(loaded, spec, prompts, args.max_tokens)
            spec_s.append(seconds)
            identical = identical and spec_out == plain_out
        tokens = args.batch * args.max_tokens
        plain_rate, spec_rate = tokens / statistics.median(plain_s), tokens / statistics.median(spec_s)
        accepted_per_token = counts.num_accepted_tokens / tokens
        print(f"| {name} | {plain_rate:.1f} | {spec_rate:.1f} | **{spec_rate / plain_rate:.2f}x** | "
              f"{counts.acceptance_rate:.0%} ({counts.num_accepted_tokens}/{counts.num_draft_tokens}) | "
              f"{accepted_per_token:.2f} | {'yes' if identical else 'NO'} |")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
