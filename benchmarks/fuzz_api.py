"""Fuzz the HTTP API: schemathesis against the server's own OpenAPI schema, then hand-written hostile cases.

Schemathesis reads `/openapi.json` (FastAPI generates it from the request models) and sends
requests built from it, valid ones (positive) and ones that break it (negative), to every
operation. The hostile cases are what a schema-driven fuzzer rarely builds: huge max_tokens,
n = 1000, a 10 MB body, invalid UTF-8, lone surrogates, JSON nested 100,000 deep, negative
logprobs, unknown roles, empty message lists, a batch of 2,000 prompts. The figure: N requests ->
0 responses 5xx, every error in OpenAI's shape, the server alive, its memory back to its baseline.

    python benchmarks/fuzz_api.py --tiny --examples 1000        # sits serve on a tiny random Llama (fast)
    python benchmarks/fuzz_api.py --serve "--device cpu --max-model-len 64" --examples 100   # SmolLM2 (slow)
    python benchmarks/fuzz_api.py --url http://127.0.0.1:8000 --pid PID --examples 1000

--tiny writes a random 2-layer Llama with SmolLM2's tokenizer to a temporary directory: the API, the
tokenizer and the engine are the real ones, only the weights are small, so the sweep spends its time
on requests rather than on generating text.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script, also with PYTHONSAFEPATH=1
    # Import the `benchmarks` package from the repository root, then take the root off sys.path again:
    # its `operator/` and `kernels/` folders must not shadow the standard library's and others' modules.
    _root = str(Path(__file__).resolve().parents[1])
    sys.path.insert(0, _root)
    import benchmarks  # noqa: F401
    sys.path.remove(_root)

from benchmarks.server_process import rss_mb, sits_serve  # noqa: E402

OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class Finding:
    """A response a hardened server must never give."""

    operation: str
    status: int
    problem: str
    request: str

    def __str__(self) -> str:
        return f"{self.operation} -> {self.status}: {self.problem}\n    {self.request[:300]}"


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        """Responses with a 5xx status; 503 counts too (nothing here should overload or stop the server)."""
        return sum(count for status, count in self.statuses.items() if status >= 500)

    def merge(self, other: FuzzReport) -> None:
        self.requests += other.requests
        self.statuses.update(other.statuses)
        self.findings.extend(other.findings)
        self.seconds += other.seconds


def problem_with(path: str, status: int, content_type: str, body: bytes) -> str | None:
    """Why this response is not acceptable, or None: no 5xx, and every API error in OpenAI's shape."""
    if status >= 500:
        return "a server error"
    if b"Traceback" in body:
        return "a traceback in the body"
    if status >= 400 and path.startswith("/v1/"):
        try:
            error = json.loads(body)["error"]
            if set(error) != OPENAI_ERROR_FIELDS or not error["message"]:
                return f"not OpenAI's error shape: {body[:200]!r}"
        except (ValueError, KeyError, TypeError):
            return f"not OpenAI's error JSON ({content_type}): {body[:200]!r}"
    return None


def schema_sweep(url: str, max_examples: int, headers: dict[str, str] | None = None, seed: int = 0,
                 timeout_s: float = 120.0) -> FuzzReport:
    """Positive and negative examples from /openapi.json for every operation, `max_examples` each per mode."""
    import hypothesis
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    report = FuzzReport()
    started = time.perf_counter()
    settings = hypothesis.settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
                                   suppress_health_check=list(hypothesis.HealthCheck),
                                   phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:
            run = hypothesis.seed(seed)(settings(hypothesis.given(case=operation.as_strategy(generation_mode=mode))(
                _sender(url, operation.label, report, headers, timeout_s))))
            try:
                run()
            except hypothesis.errors.Unsatisfiable:
                continue  # e.g. no way to break the schema of an operation without parameters
    report.seconds = time.perf_counter() - started
    return report


def _sender(url: str, label: str, report: FuzzReport, headers: dict[str, str] | None,
            timeout_s: float) -> Callable[..., None]:
    def send(case) -> None:  # a schemathesis Case
        response = case.call(base_url=url, headers=headers, timeout=timeout_s)
        report.requests += 1
        report.statuses[response.status_code] += 1
        content_type = response.headers.get("content-type") or [""]  # schemathesis: name -> values
        problem = problem_with(case.path, response.status_code, content_type[0], response.content)
        if problem:
            report.findings.append(Finding(label, response.status_code, problem, case.as_curl_command()))

    return send


def _chat(**fields: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}


def hostile_cases() -> list[tuple[str, str, bytes]]:
    """(name, path, raw body) of inputs meant to crash, stall or exhaust a server."""
    deep = 100_000

    def encoded(value: object) -> bytes:
        return json.dumps(value).encode()

    return [
        ("huge max_tokens", CHAT, encoded(_chat(max_tokens=2**62))),
        ("max_tokens beyond 64 bits", CHAT, encoded(_chat(max_tokens=2**80))),
        ("n = 1000", CHAT, encoded(_chat(n=1000))),
        ("2,000 prompts x n 128", COMPLETIONS, encoded({"prompt": ["hi"] * 2000, "n": 128, "max_tokens": 1})),
        ("10 MB prompt", COMPLETIONS, encoded({"prompt": "a " * 5_000_000, "max_tokens": 1})),
        ("10 MB message", CHAT, encoded(_chat(messages=[{"role": "user", "content": "hello " * 1_700_000}]))),
        ("2.5 M token ids", COMPLETIONS, encoded({"prompt": [5] * 2_500_000, "max_tokens": 1})),
        ("100,000 messages", CHAT, encoded(_chat(messages=[{"role": "user", "content": ""}] * 100_000))),
        ("invalid UTF-8 in a string", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}'),
        ("invalid UTF-8 key", CHAT, b'{"\xff": 1}'),
        ("lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}'),
        ("lone surrogate prompt", COMPLETIONS, b'{"prompt": "a\\udfff", "max_tokens": 1}'),
        ("arrays nested 100,000 deep", CHAT, b'{"messages": ' + b"[" * deep + b"]" * deep + b"}"),
        ("objects nested 50,000 deep", CHAT, b'{"x": ' + b'{"a":' * (deep // 2) + b"1" + b"}" * (deep // 2) + b"}"),
        ("a 5,000-digit integer", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + b"9" * 5000 + b"}"),
        ("NaN temperature", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
        ("1e400 temperature", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}'),
        ("negative logprobs", COMPLETIONS, encoded({"prompt": "hi", "logprobs": -1, "max_tokens": 1})),
        ("negative top_logprobs", CHAT, encoded(_chat(logprobs=True, top_logprobs=-3))),
        ("unknown role", CHAT, encoded(_chat(messages=[{"role": "wizard", "content": "x"}]))),
        ("empty message list", CHAT, encoded(_chat(messages=[]))),
        ("10,000 stop strings", CHAT, encoded(_chat(stop=["x"] * 10_000))),
        ("a 100,000-character name", CHAT, encoded(_chat(messages=[{"role": "user", "content": "x",
                                                                     "name": "n" * 100_000}]))),
        ("template syntax in content", CHAT, encoded(_chat(messages=[{"role": "user", "content":
                                                                     "{% for x in range(10**9) %}{% endfor %}"}]))),
        ("not JSON at all", CHAT, b"\x00\x01\x02 definitely not json"),
        ("empty body", COMPLETIONS, b""),
    ]


def hostile_sweep(url: str, headers: dict[str, str] | None = None, timeout_s: float = 120.0,
                  on_case: Callable[[str, httpx.Response, float], None] | None = None) -> FuzzReport:
    """Send every hostile case once; each must be answered (4xx or 200) quickly, never 5xx."""
    report = FuzzReport()
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=timeout_s, headers=headers) as http:
        for name, path, body in hostile_cases():
            sent = time.perf_counter()
            response = http.post(path, content=body, headers={"content-type": "application/json"})
            report.requests += 1
            report.statuses[response.status_code] += 1
            problem = problem_with(path, response.status_code, response.headers.get("content-type", ""),
                                   response.content)
            if problem:
                report.findings.append(Finding(name, response.status_code, problem, body[:200].decode(errors="replace")))
            if on_case is not None:
                on_case(name, response, time.perf_counter() - sent)
    report.seconds = time.perf_counter() - started
    return report


def write_tiny_model(directory: str) -> str:
    """A random Llama (2 layers, hidden 64, GQA) with SmolLM2's tokenizer, saved as an HF checkpoint."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sits.runtime.models.embedded import embedded_gguf_path
    from sits.runtime.models.gguf_cache import cached_checkpoint_dir

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer_dir = cached_checkpoint_dir(embedded_gguf_path(), progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, os.path.join(directory, name))
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server")
    target.add_argument("--serve", metavar="ARGS", help="start `sits serve ARGS` for the run (quoted string)")
    target.add_argument("--tiny", action="store_true", help="start `sits serve` on a tiny random Llama")
    parser.add_argument("--pid", type=int, default=None, help="the server's pid, for its RSS (with --url)")
    parser.add_argument("--examples", type=int, default=300, help="schemathesis examples per operation and mode")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    with contextlib.ExitStack() as stack:
        url, pid = args.url, args.pid
        serve_args = shlex.split(args.serve) if args.serve is not None else None
        if args.tiny:
            model_dir = write_tiny_model(stack.enter_context(tempfile.TemporaryDirectory(prefix="sits-tiny-")))
            serve_args = ["--model", model_dir, "--device", "cpu", "--max-model-len", "128", "--max-num-seqs", "8"]
        if serve_args is not None:
            log_path = os.path.join(tempfile.gettempdir(), f"sits-fuzz-{os.getpid()}.log")
            url, pid = stack.enter_context(sits_serve(serve_args, log_path))
            print(f"sits serve {shlex.join(serve_args)} at {url} (log {log_path})", flush=True)
        hostile_sweep(url, headers)  # warm-up: the allocator's high-water mark for the largest bodies
        baseline = rss_mb(pid)
        report = hostile_sweep(url, headers, on_case=lambda name, r, s: print(f"  {name:32s} {r.status_code} {s:6.2f} s"))
        report.merge(schema_sweep(url, args.examples, headers, args.seed))
        report.merge(hostile_sweep(url, headers))
        alive = httpx.get(f"{url}/health", timeout=30).status_code == 200
        after = rss_mb(pid)
    for finding in report.findings:
        print(finding)
    print(f"{report.requests} requests in {report.seconds:.0f} s -> {report.server_errors} responses 5xx, "
          f"{len(report.findings)} findings; statuses {dict(sorted(report.statuses.items()))}; server alive: {alive}")
    if baseline is not None:
        print(f"server RSS: {baseline} MB after a warm-up sweep, {after} MB at the end")
    return 0 if alive and not report.findings else 1


if __name__ == "__main__":
    sys.exit(main())
