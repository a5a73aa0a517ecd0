"""CPU serving throughput: SITS (`sits serve`, continuous batching) vs transformers `generate`, one by one.

Both run SmolLM2-135M-Instruct in float32 on this machine's CPU, on the same chat prompts, greedy,
with exactly --max-tokens output tokens per request (EOS ignored / suppressed on both sides). SITS
gets all requests at once through the real HTTP server and the official openai client; the peer
runs them one after another, which is how a plain transformers script serves them. Both are measured
in the same run; the ratio of aggregate output tokens per second is the figure (target >= 3x).

    python benchmarks/bench_cpu_serving.py [--concurrency 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import torch

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    # Import the `benchmarks` package from the repository root, then take the root off sys.path again:
    # its `operator/` and `kernels/` folders must not shadow the standard library's and others' modules.
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from benchmarks.run_report import cpu_name  # noqa: E402
from benchmarks.server_process import free_port, stop_process  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a child.", "What are the three primary colors?", "How do airplanes fly?",
    "Give me a recipe for pancakes.", "What is the tallest mountain on Earth?", "Describe a cat in one sentence.",
    "How many legs does a spider have?", "What does a computer's CPU do?", "Name three planets and a fact each.",
    "Why do leaves change color in autumn?", "What is the boiling point of water?", "Tell me a short joke.",
    "How do bees make honey?", "What is gravity?", "Suggest a name for a pet goldfish.",
    "What is the largest ocean?", "Explain what a rainbow is.",
]


@dataclass
class Run:
    """One side's figures."""

    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def start_server(port: int, concurrency: int, log, extra_args: Sequence[str] = ()) -> subprocess.Popen:
    """`sits serve` on SmolLM2 (plus extra_args), returned once /health answers 200."""
    argv = [sys.executable, "-m", "sits.runtime", "serve", "--device", "cpu", "--dtype", "float32",
            "--port", str(port), "--max-num-seqs", str(max(concurrency, 1)), "--max-model-len", "2048",
            "--log-level", "warning", *extra_args]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONSAFEPATH": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sits serve exited with {process.returncode}; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_process(process, grace_s=5)
    raise TimeoutError("sits serve did not become ready within 300 s")


async def sits_run(base_url: str, model: str, prompts: list[str], max_tokens: int,
                   api_key: str = "unused") -> tuple[Run, list[float]]:
    """All prompts at once as streamed chat requests; returns the run and each request's TTFT (s)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)

    async def one(question: str) -> tuple[int, float]:
        started = time.perf_counter()
        first = None
        tokens = 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, first or 0.0

    await one(prompts[0])  # warm-up: first-call costs stay out of the figure
    started = time.perf_counter()
    results = await asyncio.gather(*(one(q) for q in prompts))
    seconds = time.perf_counter() - started
    await client.close()
    return Run(len(prompts), sum(t for t, _ in results), seconds), [ttft for _, ttft in results]


def transformers_run(prompts: list[str], max_tokens: int) -> Run:
    """The peer: transformers reading the same GGUF, generate() one prompt after another."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sits.runtime.models.embedded import embedded_gguf_path

    path = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    def generate(question: str, new_tokens: int) -> int:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return out.shape[1] - ids["input_ids"].shape[1]

    generate(prompts[0], 4)  # warm-up
    started = time.perf_counter()
    tokens = sum(generate(q, max_tokens) for q in prompts)
    return Run(len(prompts), tokens, time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent chat requests")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    args = parser.parse_args()
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.concurrency)]
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    print(f"{args.concurrency} chat requests x {args.max_tokens} output tokens, SmolLM2-135M-Instruct fp32, greedy")
    print("load average (1/5/15 min) at the start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))

    port = free_port()
    with tempfile.NamedTemporaryFile("w+b", prefix="sits-bench-", suffix=".log", delete=False) as log:
        server = start_server(port, args.concurrency, log)
        try:
            model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
            sits, ttfts = asyncio.run(sits_run(f"http://127.0.0.1:{port}/v1", model, prompts, args.max_tokens))
        finally:
            stop_process(server)
    peer = transformers_run(prompts, args.max_tokens)

    ratio = sits.tokens_per_s / peer.tokens_per_s
    ttfts.sort()
    print(f"{'':34}{'output tokens':>14}{'seconds':>10}{'tok/s':>10}")
    print(f"{'SITS serve, concurrent':34}{sits.output_tokens:>14}{sits.seconds:>10.2f}{sits.tokens_per_s:>10.1f}")
    print(f"{'transformers generate, one by one':34}{peer.output_tokens:>14}{peer.seconds:>10.2f}"
          f"{peer.tokens_per_s:>10.1f}")
    print(f"SITS TTFT: median {ttfts[len(ttfts) // 2]:.2f} s, max {ttfts[-1]:.2f} s")
    print(f"ratio (SITS / transformers): {ratio:.2f}x (target >= 3x)")
    # Other work on the same cores slows the one-by-one peer far more than the batched server.
    print("load average (1/5/15 min) at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
