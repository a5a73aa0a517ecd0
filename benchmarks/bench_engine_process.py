"""Served throughput with the engine in its own process (`sits serve`'s default) against the engine on a
thread of the server (`--engine-in-process`), same model, same flags, same load, in the same run.

C clients stream completions of exactly --max-tokens tokens each (EOS ignored) through the official
openai client, all at once, --rounds times; the figure is aggregate output tokens per second.

    python benchmarks/bench_engine_process.py [--model DIR] [--concurrency 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import openai

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from benchmarks.server_process import sits_serve  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper and a storm."


async def one_stream(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> int:
    stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True},
                                             stream_options={"include_usage": True})
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


async def load(url: str, concurrency: int, max_tokens: int, rounds: int) -> tuple[float, int]:
    """(output tok/s over all rounds, tokens) for `concurrency` simultaneous streams per round."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    await one_stream(client, model, 4)  # warm-up
    started, tokens = time.perf_counter(), 0
    for _ in range(rounds):
        tokens += sum(await asyncio.gather(*(one_stream(client, model, max_tokens) for _ in range(concurrency))))
    elapsed = time.perf_counter() - started
    await client.close()
    return tokens / elapsed, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    common = ["--device", "cpu", "--max-model-len", "512", "--num-blocks", str(4 * args.concurrency * 8),
              "--max-num-seqs", str(args.concurrency), "--log-level", "warning"]
    if args.model:
        common += ["--model", args.model]
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, extra in (("engine process", []), ("in-process", ["--engine-in-process"])):
            with sits_serve(common + extra, f"{logs}/{name}.log") as (url, _pid):
                results[name] = asyncio.run(load(url, args.concurrency, args.max_tokens, args.rounds))
    for name, (rate, tokens) in results.items():
        print(f"{name:>15}: {rate:8.1f} output tok/s ({tokens} tokens, {args.concurrency} streams x "
              f"{args.max_tokens} tokens x {args.rounds} rounds)")
    print(f"engine process / in-process: {results['engine process'][0] / results['in-process'][0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
