"""`sits bench serve`: an online benchmark of any OpenAI-compatible server, with `vllm bench serve`'s semantics.

    sits bench serve --base-url http://127.0.0.1:8000 --random-input-len 1024 --random-output-len 512 \\
        --num-prompts 1024 --max-concurrency 256
    sits bench serve --launch "--load-format dummy --config tiny" --num-prompts 64 --max-concurrency 32

Requests stream; TTFT, TPOT, ITL and E2E latency come from each request's chunk arrival times
(`bench_serve_metrics.py` defines them), the prefix-cache hit rate and preemptions from the
server's /metrics read before and after the run. The client path imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from sits.runtime.commands.bench_serve_client import ENDPOINTS, LoadShape, Target
from sits.runtime.commands.bench_serve_dataset import DATASETS, PROMPT_FORMATS, BenchRequest, Tenant
from sits.runtime.commands.bench_serve_metrics import RequestRecord

PROG = "sits bench serve"
DEFAULT_URL = "http://127.0.0.1:8000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=None, metavar="URL",
                        help=f"the server's root URL, without /v1 (default: {DEFAULT_URL}, or the --launch'ed one)")
    server.add_argument("--launch", default=None, metavar="SERVE_ARGS",
                        help='start `sits serve SERVE_ARGS` on a free 127.0.0.1 port for the run, e.g. '
                             '"--load-format dummy --config tiny"; it is stopped at the end (also on error/Ctrl-C)')
    server.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    server.add_argument("--model", default=None, help="the model id sent (default: the first of /v1/models)")
    server.add_argument("--api-key", default="", help="Bearer key of every request (datasets with tenants send "
                                                      "each tenant's own key)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", default="random", choices=DATASETS)
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (prefix-repetition: "
                                                                         "the suffix after the tenant's prefix)")
    data.add_argument("--random-output-len", type=int, default=128, help="output tokens (max_tokens)")
    data.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                      help="lengths are uniform in [len x (1 - R), len x (1 + R)]; 0: exact (0 <= R < 1)")
    data.add_argument("--prompt-format", default="ids", choices=PROMPT_FORMATS,
                      help="ids: token-id prompts (a --load-format dummy server, or any that takes them); "
                           "text: random words, for servers with a real tokenizer")
    data.add_argument("--vocab-size", type=int, default=None,
                      help="ids are drawn below this (default: the launched dummy shape's vocabulary, else 32000)")
    data.add_argument("--num-tenants", type=int, default=4, help="prefix-repetition: tenants")
    data.add_argument("--users-per-tenant", type=int, default=4, help="prefix-repetition: users of each tenant")
    data.add_argument("--prefix-len", type=int, default=512, help="prefix-repetition: tokens of each tenant's prefix")
    data.add_argument("--tenants-file", default=None, metavar="FILE",
                      help="prefix-repetition: a `sits serve --tenants` YAML whose tenants' apiKeys are sent "
                           "(default: generated keys; with --launch the matching tenants file is passed too)")
    data.add_argument("--seed", type=int, default=0)
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier, > 1 more regular")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="send ignore_eos and min_tokens so every output has exactly max_tokens tokens")
    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS (a request is good within all given)")
    report.add_argument("--json", default=None, metavar="FILE", help="write the figures and every request's record")
    report.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar (default: on a terminal; plain lines otherwise)")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="online benchmark of an OpenAI-compatible server",
                                   description="Benchmark an OpenAI-compatible server online (vllm bench serve's "
                                               "metrics), or a `sits serve` it launches.")
    add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


class BenchArgsError(ValueError):
    """A bad flag combination (the message names the flag)."""


def check_args(args: argparse.Namespace) -> dict[str, float]:
    """Validate the flags; the goodput SLOs in seconds. Raises BenchArgsError naming the flag."""
    from sits.runtime.commands.bench_serve_metrics import parse_goodput

    for flag in ("num_prompts", "random_input_len", "random_output_len", "num_tenants", "users_per_tenant"):
        if getattr(args, flag) < 1:
            raise BenchArgsError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.prefix_len < 0:
        raise BenchArgsError(f"--prefix-len must be >= 0, got {args.prefix_len}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise BenchArgsError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0:
        raise BenchArgsError(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise BenchArgsError(f"--burstiness must be a positive number, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchArgsError(f"--max-concurrency must be positive, got {args.max_concurrency}")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise BenchArgsError(f"--vocab-size must be positive, got {args.vocab_size}")
    if args.launch is not None and args.base_url is not None:
        raise BenchArgsError("--launch and --base-url cannot be used together (--launch picks the URL)")
    if args.tenants_file is not None and args.dataset_name != "prefix-repetition":
        raise BenchArgsError("--tenants-file needs --dataset-name prefix-repetition")
    try:
        return parse_goodput(args.goodput)
    except ValueError as error:
        raise BenchArgsError(str(error)) from None


def launched_vocab_size(serve_args: str | None) -> int | None:
    """The vocabulary of the dummy shape a --launch'ed server serves (`--config NAME`), else None."""
    import shlex

    if not serve_args:
        return None
    args = shlex.split(serve_args)
    names = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"]
    names += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    if not names:
        return None
    from sits.runtime.models.presets import PRESETS

    shape = PRESETS.get(names[-1])
    return shape.vocab_size if shape is not None else None


def build_requests(args: argparse.Namespace) -> tuple[list[BenchRequest], list[Tenant]]:
    from sits.runtime.commands import bench_serve_dataset as dataset

    vocab = args.vocab_size or launched_vocab_size(args.launch) or 32000
    if args.dataset_name == "random":
        return dataset.random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                       args.random_range_ratio, vocab, args.prompt_format, args.seed), []
    tenants = (dataset.tenants_from_file(args.tenants_file) if args.tenants_file is not None
               else dataset.generated_tenants(args.num_tenants))
    requests = dataset.prefix_repetition_requests(
        args.num_prompts, tenants, args.users_per_tenant, args.prefix_len, args.random_input_len,
        args.random_output_len, args.random_range_ratio, vocab, args.prompt_format, args.seed)
    return requests, tenants


class Progress:
    """A tqdm bar on a terminal, else a plain line at every tenth of the requests."""

    def __init__(self, total: int, bar: bool) -> None:
        self.total, self.done = total, 0
        self._bar = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", file=sys.stderr)

    def __call__(self, record: RequestRecord) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.done == self.total or self.done % math.ceil(self.total / 10) == 0:
            print(f"{PROG}: {self.done}/{self.total} requests done", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def benchmark(args: argparse.Namespace, base_url: str, slos: dict[str, float], requests: list[BenchRequest],
                    tenants: list[Tenant]) -> dict[str, Any]:
    """Send `requests` to base_url as the flags say; print the table, write --json; the report."""
    from sits.runtime.commands import bench_serve_client as client
    from sits.runtime.commands.bench_serve_metrics import (
        compute_report,
        format_report,
        server_counters,
        to_json,
    )

    key = args.api_key or (tenants[0].api_key if tenants else "")
    model = args.model or await client.served_model(base_url, key)
    target = Target(base_url=base_url, endpoint=args.endpoint, model=model, api_key=args.api_key,
                    ignore_eos=args.ignore_eos)
    shape = LoadShape(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    before = await client.read_metrics(base_url, key)
    progress = Progress(len(requests), sys.stderr.isatty() if args.progress is None else args.progress)
    try:
        records, duration = await client.run_load(target, requests, shape, progress)
    finally:
        progress.close()
    after = await client.read_metrics(base_url, key)
    report = compute_report(records, duration, slos, server_counters(before, after))
    setup = {"base_url": base_url, "launch": args.launch, "endpoint": args.endpoint, "model": model,
             "dataset": args.dataset_name, "num_prompts": args.num_prompts, "input_len": args.random_input_len,
             "output_len": args.random_output_len, "range_ratio": args.random_range_ratio,
             "prompt_format": args.prompt_format, "request_rate": args.request_rate, "burstiness": args.burstiness,
             "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos,
             "tenants": [t.name for t in tenants], "prefix_len": args.prefix_len if tenants else 0}
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    print(f"{PROG}: {model} at {base_url}{args.endpoint}: {args.dataset_name}, {len(requests)} prompts, rate {rate}"
          f" (burstiness {args.burstiness:g}), max concurrency {args.max_concurrency or 'none'}")
    print(format_report(report), flush=True)
    if args.json:
        Path(args.json).write_text(to_json(report, setup, records))
    return report


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C, so a launched server is stopped


def run(args: argparse.Namespace) -> int:
    from sits.runtime.commands.bench_serve_launch import LaunchError, launched
    from sits.runtime.commands.engine_args import fail

    try:
        slos = check_args(args)
        requests, tenants = build_requests(args)  # a bad --tenants-file fails before a server starts
    except (BenchArgsError, ValueError) as error:
        return fail(PROG, str(error))
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        extra = {}
        if args.launch is not None and args.dataset_name == "prefix-repetition" and args.tenants_file is None \
                and "--tenants" not in args.launch:
            from sits.runtime.commands.bench_serve_dataset import tenants_yaml

            extra["--tenants"] = tenants_yaml(tenants)
        server = launched(args.launch, extra) if args.launch is not None else nullcontext(args.base_url or DEFAULT_URL)
        with server as base_url:
            asyncio.run(benchmark(args, base_url.rstrip("/"), slos, requests, tenants))
    except (LaunchError, RuntimeError) as error:
        return fail(PROG, str(error))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


__all__ = ["add_arguments", "check_args", "register", "run"]
