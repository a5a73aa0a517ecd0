"""`sits bench`: offline throughput of the engine on one batch, beside HF transformers on the same GPU.

    sits bench --config llama-3-8b --batch 32 --input-len 2048 --output-len 512
    sits bench --model /models/llama-3-8b --quantization fp8 --peer none
    sits bench serve --launch "--load-format dummy --config tiny"   (online: see bench_serve.py)

The batch is `batch` prompts of random token ids (seeded), submitted at once; every sequence
generates exactly output_len tokens (greedy, EOS ignored). A named config gets seeded random weights;
transformers runs the very same weights (`bench_peer.py`) in the same process, first, and the
table at the end shows both, the ratio, TTFT and ITL percentiles and the fraction of the roofline
(`bench_report.py`). Before its timed run the engine runs a warm-up batch of other random prompts
(same shapes, a few output tokens), so Triton's compilation and autotuning stay out of the figure;
the warm-up prompts never hit the prefix cache of the timed ones.

`--peer-output-tok-s` reuses a transformers figure measured earlier instead of measuring it (local
iteration only: the table marks it as given, not measured).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from sits.runtime.commands.engine_args import (
    ConfigError,
    add_engine_arguments,
    configure_logging,
    engine_config_from_args,
    fail,
)

PROG = "sits bench"
logger = logging.getLogger("sits.bench")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--batch", type=int, default=32, help="prompts submitted at once")
    bench.add_argument("--input-len", type=int, default=2048, help="tokens per prompt")
    bench.add_argument("--output-len", type=int, default=512, help="tokens generated per prompt")
    bench.add_argument("--warmup-output-len", type=int, default=8,
                       help="output tokens of the warm-up batch (0: no warm-up)")
    bench.add_argument("--peer", default="transformers", type=_peer_list,
                       help="the systems measured beside SITS in the same run, comma-separated: transformers "
                            "(HF generate), compiled (a static KV cache and a torch.compile'd decode step, "
                            "static_peer.py), or none")
    bench.add_argument("--peer-output-tok-s", type=float, default=None, metavar="TOK_S",
                       help="reuse this transformers output tok/s instead of measuring it (local iteration only)")
    bench.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON here")
    bench.add_argument("--detokenize", action=argparse.BooleanOptionalAction, default=True,
                       help="decode each step's text in the engine, as vLLM's offline benchmark does (default); "
                            "--no-detokenize: token ids only, as the engine process runs under `sits serve` (the "
                            "API server decodes) and as TensorRT-LLM's benchmark counts")
    add_engine_arguments(parser)


def new_engine(args: argparse.Namespace, loaded, config, **hooks):
    """The LLMEngine a benchmark times, decoding text unless `--no-detokenize`. Its snapshots carry each step's
    deltas only (the benchmark reads nothing else): no copy of every completion's token ids and text, which
    would grow with each token and make a long output's steps ever slower on the host."""
    from sits.runtime.engine.engine import LLMEngine

    engine = LLMEngine.from_loaded(loaded, config, **hooks)
    engine.output_processor.detokenize = getattr(args, "detokenize", True)
    engine.output_processor.cumulative = False
    return engine


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="offline throughput, beside HF transformers",
                                   description="Offline throughput of one batch, beside HF transformers.")
    add_bench_arguments(parser)
    parser.set_defaults(handler=run)
    from sits.runtime.cli import OneLineErrorParser
    from sits.runtime.commands import bench_serve

    modes = parser.add_subparsers(dest="bench_mode", metavar="MODE", parser_class=OneLineErrorParser,
                                  help="serve: online benchmark of an OpenAI-compatible server (without MODE: "
                                       "offline, as above)")
    bench_serve.register(modes)
    return parser


PEERS = ("transformers", "compiled")


def _peer_list(value: str) -> tuple[str, ...]:
    """--peer's value: "none", or peers from PEERS, comma-separated, each once."""
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    if names == ("none",):
        return ()
    unknown = [name for name in names if name not in PEERS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected none or some of {', '.join(PEERS)} (comma-separated, each once), "
                                         f"got {value!r}")
    return names


def _check_args(args: argparse.Namespace) -> None:
    if (args.config is None) == (args.model is None):
        raise ConfigError("give exactly one of --config NAME (random weights) or --model PATH")
    for flag in ("batch", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.warmup_output_len < 0:
        raise ConfigError(f"--warmup-output-len must be >= 0, got {args.warmup_output_len}")
    if args.peer_output_tok_s is not None and args.peer_output_tok_s <= 0:
        raise ConfigError(f"--peer-output-tok-s must be positive, got {args.peer_output_tok_s}")


def build_config(args: argparse.Namespace):
    """The EngineConfig of the run: the batch's context as max_model_len, max_num_seqs = batch by default."""
    _check_args(args)
    if args.config is not None and args.load_format is None:
        args.load_format = "dummy"  # offline, a named shape always means random weights
    if args.max_model_len is None:
        args.max_model_len = args.input_len + args.output_len
    if args.max_num_seqs is None:
        args.max_num_seqs = args.batch
    return engine_config_from_args(args)


def load(args: argparse.Namespace, config):
    """The LoadedModel: a named shape with seeded random weights, or a checkpoint."""
    from sits.runtime.attention.registry import BackendUnavailableError, select_backend
    from sits.runtime.models import loading

    device, dtype = loading.resolve_device_dtype(config.model)
    if args.config is not None:
        from sits.runtime.models.presets import preset_config
        from sits.runtime.models.random_model import random_loaded_model

        try:
            shape = preset_config(args.config)
        except ValueError as error:
            raise ConfigError(f"--config: {error}") from error
        backend = _backend(select_backend, BackendUnavailableError, config, device, dtype, shape.head_dim)
        return random_loaded_model(shape, backend, device, dtype, config.model.seed,
                                   max(shape.max_position_embeddings, config.model.max_model_len), args.config)
    shape = loading.read_model_config(config.model, progress=False)
    backend = _backend(select_backend, BackendUnavailableError, config, device, dtype, shape.head_dim)
    return loading.load_model(config.model, backend, progress=False)


def _backend(select_backend, unavailable, config, device, dtype, head_dim):
    try:
        return select_backend(config.attention_backend, device, dtype, head_dim)
    except unavailable as error:
        raise ConfigError(f"--attention-backend: {error}") from error


def random_prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator).tolist()


def run_engine(engine, prompts: list[list[int]], output_len: int, tag: str):
    """Submit the batch at once and step to the end; a RunResult with per-token timestamps."""
    from sits.runtime.commands.bench_report import RunResult
    from sits.runtime.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    token_times: dict[str, list[float]] = defaultdict(list)
    start = time.perf_counter()
    cpu_start = time.process_time()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
    now = start
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            token_times[output.request_id].extend([now] * len(output.outputs[0].token_ids_delta))
    cpu_s = time.process_time() - cpu_start
    short = {rid: len(times) for rid, times in token_times.items() if len(times) != output_len}
    if short or len(token_times) != len(prompts):
        raise RuntimeError(f"the engine generated the wrong number of tokens: {short}")
    gaps = [b - a for times in token_times.values() for a, b in zip(times, times[1:], strict=False)]
    return RunResult(system="SITS", seconds=now - start, output_tokens=len(prompts) * output_len,
                     prompt_tokens=sum(map(len, prompts)), ttft_s=[t[0] - start for t in token_times.values()],
                     itl_s=gaps, cpu_s=cpu_s)


def _system_label(engine, config) -> str:
    model = engine.loaded_model
    graphs = "CUDA graphs" if getattr(engine.runner, "decode_graphs", None) is not None else "eager"
    quant = "" if config.model.quantization == "none" else f" {config.model.quantization} weights"
    cache = f", fp8 KV cache ({config.cache.kv_cache_scales} scales)" if config.cache.fp8 else ""
    text = "" if engine.output_processor.detokenize else ", token ids only"
    return (f"SITS {str(model.dtype).removeprefix('torch.')}{quant}{cache}, {model.model.backend.name} attention, "
            f"{graphs}{text}")


def _roofline(engine, args, config):
    from sits.runtime.commands.bench_report import roofline
    from sits.runtime.hardware import detect_gpu

    profile = detect_gpu(engine.loaded_model.device) if engine.loaded_model.device.type == "cuda" else None
    if profile is None:
        return None, None
    model = engine.loaded_model.model
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    weight_bytes += sum(t.numel() * t.element_size() for name, t in model.named_buffers() if "cos_sin" not in name)
    fp8 = config.model.quantization == "fp8" and profile.fp8_flops
    rate = profile.fp8_flops if fp8 else profile.bf16_flops
    kv_bytes = engine.runner.kv_shape.dtype.itemsize
    floor = roofline(engine.loaded_model.config, weight_bytes, args.batch, args.input_len, args.output_len, rate,
                     profile.hbm_bytes_per_s, kv_bytes)
    return floor, profile


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        config = build_config(args)
        loaded = load(args, config)
    except ConfigError as error:
        return fail(PROG, str(error))
    except Exception as error:  # noqa: BLE001 - a load error is one line, not a traceback
        from sits.runtime.models.errors import ModelLoadError

        if isinstance(error, ModelLoadError | FileNotFoundError):
            return fail(PROG, str(error))
        raise
    return benchmark(args, config, loaded)


def benchmark(args: argparse.Namespace, config, loaded) -> int:
    """Peers first (they need the GPU memory the engine's KV cache takes later), then SITS; print the table."""
    from sits.runtime.commands.bench_report import format_table, to_json

    vocab = loaded.config.vocab_size
    prompts = random_prompts(args.batch, args.input_len, vocab, config.model.seed + 1)
    try:
        peers = _run_peers(args, loaded, prompts)
        engine = new_engine(args, loaded, config)
    except ConfigError as error:
        return fail(PROG, str(error))
    if args.warmup_output_len:
        warmup = random_prompts(args.batch, args.input_len, vocab, config.model.seed + 2)
        begin = time.perf_counter()
        run_engine(engine, warmup, min(args.warmup_output_len, args.output_len), "warmup")
        logger.info("warm-up batch (compiles and autotunes kernels): %.1f s", time.perf_counter() - begin)
    from sits.runtime.gc_heap import frozen_startup_heap

    before = engine.stats()
    with frozen_startup_heap(PROG):  # as the engine process does before serving (gc_heap.py)
        result = run_engine(engine, prompts, args.output_len, "bench")
    result.system = _system_label(engine, config)
    after = engine.stats()
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    preemptions = after.num_preemptions - before.num_preemptions
    result.notes = f"prefix-cache hits during the timed run: {hits}; preemptions: {preemptions}"
    floor, profile = _roofline(engine, args, config)
    setup = {"batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
             "model": args.config or args.model, "device": profile.name if profile else str(loaded.device),
             "max_num_seqs": config.scheduler.max_num_seqs,
             "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
             "quantization": config.model.quantization, "versions": _versions()}
    print(f"\n{PROG}: {setup['model']} on {setup['device']}: batch {args.batch}, {args.input_len} in / "
          f"{args.output_len} out; {result.notes}")
    print(format_table([result], peers, floor))
    if args.json:
        Path(args.json).write_text(to_json([result], peers, floor, setup))
    return 0


def _run_peers(args: argparse.Namespace, loaded, prompts: list[list[int]]) -> list:
    """The peers `--peer` names, each run on the batch before the engine exists (its KV cache would take their
    memory): transformers (or the figure `--peer-output-tok-s` gives), then the compiled static-cache decoder."""
    from sits.runtime.commands.bench_report import RunResult

    peers = []
    if args.peer_output_tok_s is not None:
        seconds = args.batch * args.output_len / args.peer_output_tok_s
        peers.append(RunResult("transformers generate", seconds, args.batch * args.output_len,
                               args.batch * args.input_len, measured=False, short="transformers"))
    elif "transformers" in args.peer:
        from sits.runtime.commands.bench_peer import run_transformers

        logger.info("transformers: %d prompts x %d tokens -> %d tokens each", args.batch, args.input_len,
                    args.output_len)
        peers.append(run_transformers(loaded.model, prompts, args.output_len, loaded.device, loaded.dtype))
    if "compiled" in args.peer:
        from sits.runtime.commands.static_peer import run_static_compiled

        logger.info("static-cache peer: compiling its decode step, then %d prompts x %d tokens", args.batch,
                    args.input_len)
        try:
            peers.append(run_static_compiled(loaded.model, prompts, args.output_len, loaded.device))
        except ValueError as error:  # a quantized model: the peer runs unquantized weights only
            raise ConfigError(f"--peer compiled: {error}") from None
        except Exception as error:  # noqa: BLE001 - e.g. torch.compile failing: SITS is still measured
            logger.error("the static-cache peer failed, measured without it: %s: %s", type(error).__name__,
                         str(error).splitlines()[0] if str(error) else "")
    for peer in peers:
        logger.info("%s: %.2f s, %.0f output tok/s", peer.system, peer.seconds, peer.output_tok_s)
    return peers


def _versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {}
    for package in ("torch", "triton", "transformers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "absent"
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """benchmarks/bench_e2e.py's entry: the same command without the `sits` front end."""
    from sits.runtime.cli import OneLineErrorParser

    parser = OneLineErrorParser(prog="bench_e2e.py", description=__doc__.split("\n\n")[0])
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["benchmark", "build_config", "main", "register", "run", "run_engine"]
