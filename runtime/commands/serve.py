"""`sits serve`: load a model and serve the OpenAI-compatible API until SIGTERM (then drain, exit 0)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sits.runtime.commands.engine_args import (
    ConfigError,
    add_engine_arguments,
    configure_logging,
    engine_config_from_args,
    fail,
    surely_cpu,
)
from sits.runtime.config import TOOL_CALL_PARSERS, EngineConfig, ServerConfig
from sits.runtime.server.security import (
    SecurityConfigError,
    add_security_arguments,
    bind_metrics_listener,
    security_from_args,
    serving_metrics,
)
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.state_store import redact_url
from sits.runtime.tenancy.tenants import TenantConfigError

if TYPE_CHECKING:
    from sits.runtime.tenancy.service import Tenancy

PROG = "sits serve"
API_KEY_ENV = "SITS_API_KEY"  # read when no --api-key is given (vLLM: VLLM_API_KEY)
ENGINE_IN_PROCESS_ENV = "SITS_ENGINE_IN_PROCESS"  # "1": as --engine-in-process (vLLM: VLLM_ENABLE_V1_MULTIPROCESSING=0)
EVICTION_INDEX_INTERVAL_S = 1.0  # how often the engine thread hands its eviction index to the store
logger = logging.getLogger("sits.serve")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                   description="Serve a model over the OpenAI-compatible HTTP API.")
    add_engine_arguments(parser)
    add_chat_template_argument(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=ServerConfig.host)
    server.add_argument("--port", type=int, default=ServerConfig.port)
    server.add_argument("--track", default=ServerConfig.track, help="metrics label: stable or canary")
    server.add_argument("--drain-timeout", type=float, default=ServerConfig.drain_timeout_s, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests may finish before they are aborted")
    server.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                        help="sequences that may wait behind the running batch (a request counts n x prompts); "
                             "beyond them requests get 503 with Retry-After before the engine sees them "
                             "(default: --max-num-seqs, one batch, at least 32)")
    server.add_argument("--otlp-endpoint", default=None, metavar="URL",
                        help="export request traces (queue, prefill, decode, detokenize spans) over OTLP/HTTP to "
                             "this collector, e.g. http://otel-collector:4318 (off by default; needs sits[tracing])")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto": the model decides whether to call tools, and '
                             "--tool-call-parser reads its calls out of the text (without it, \"auto\" is a 400)")
    server.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="the model's tool-call format, for tool_choice auto: hermes = "
                             "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Hermes, Qwen2.5)")
    server.add_argument("--engine-in-process", action="store_true",
                        help="run the engine's step loop on a thread of the server process instead of in its own "
                             f"process (the default); also ${ENGINE_IN_PROCESS_ENV}=1")
    add_tenancy_arguments(parser)
    add_security_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def add_chat_template_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                        help="a jinja2 chat template file, or the template itself, used in place of the model's "
                             "own (tokenizer_config.json, chat_template.jinja or GGUF metadata)")


def with_chat_template(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """`config` with `--chat-template` set and checked (read and compiled); raises ConfigError naming the flag."""
    config.model.chat_template = getattr(args, "chat_template", None)
    config.model.validate()
    return config


def add_tenancy_arguments(parser: argparse.ArgumentParser) -> None:
    tenancy = parser.add_argument_group("tenancy")
    tenancy.add_argument("--api-key", action="append", default=None, metavar="KEY",
                         help="protect a server without tenants: every /v1/* call, /tokenize and /detokenize "
                              "need `Authorization: Bearer KEY`; repeat for several keys (default: "
                              f"${API_KEY_ENV} if set, else open); not with --tenants")
    tenancy.add_argument("--tenants", default=None, metavar="FILE",
                         help="tenants YAML (names, API keys, priorities, KV shares, limits); with it every "
                              "/v1/* call needs `Authorization: Bearer <key>` (default: open, one tenant)")
    tenancy.add_argument("--state-store", default=TenancyConfig.state_store, metavar="URL",
                         help="memory:// (this process) or redis://host:port/db (shared by replicas: tenant "
                              "table, usage, eviction index, rate-limit windows)")
    tenancy.add_argument("--deployment", default=TenancyConfig.deployment, metavar="NAME",
                         help="namespace of this deployment's keys in the state store (sits:NAME:...)")
    tenancy.add_argument("--trusted-gateway-header", default=None, metavar="HEADER",
                         help="take the tenant's name from this header instead of an API key; only behind a "
                              "gateway that authenticates callers and sets it (off by default)")
    tenancy.add_argument("--eviction-alpha", type=float, default=TenancyConfig.eviction_alpha,
                         help="weight of priority in the KV eviction score t x (1 + alpha x priority)")
    tenancy.add_argument("--eviction-ttl", type=float, default=TenancyConfig.eviction_ttl_s, metavar="SECONDS",
                         help="cached KV blocks unused this long are evicted first (0: no TTL)")


def tenancy_config_from_args(args: argparse.Namespace) -> TenancyConfig:
    config = TenancyConfig(tenants_file=args.tenants, state_store=args.state_store, deployment=args.deployment,
                           trusted_gateway_header=args.trusted_gateway_header, eviction_alpha=args.eviction_alpha,
                           eviction_ttl_s=args.eviction_ttl)
    config.validate()
    return config


def api_keys_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The keys of `--api-key` (each given), else of $SITS_API_KEY; () serves without keys.

    Raises ConfigError for an empty key, and for keys together with --tenants (each tenant has its own)."""
    flagged = getattr(args, "api_key", None)
    if flagged:
        keys, source = tuple(key.strip() for key in flagged), "--api-key"
        if not all(keys):
            raise ConfigError("--api-key must not be empty")
    else:
        from_env = environ.get(API_KEY_ENV, "").strip()
        keys, source = ((from_env,) if from_env else ()), API_KEY_ENV
    if keys and getattr(args, "tenants", None) is not None:
        raise ConfigError(f"{source} and --tenants cannot be used together: with --tenants each tenant has "
                          "its own apiKey in the tenants file")
    return keys


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    config = ServerConfig(host=args.host, port=args.port, track=args.track, drain_timeout_s=args.drain_timeout,
                          enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                          tool_call_parser=getattr(args, "tool_call_parser", None))
    config.validate()
    if config.drain_timeout_s < 0:
        raise ConfigError(f"--drain-timeout must be >= 0, got {config.drain_timeout_s}")
    max_waiting = getattr(args, "max_waiting_requests", None)
    if max_waiting is not None and max_waiting < 0:
        raise ConfigError(f"--max-waiting-requests must be >= 0, got {max_waiting}")
    return config


def bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket before loading the model, so a taken port fails in a second."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from error
    sock.set_inheritable(True)
    return sock


@dataclass
class CheckedFlags:
    """What `sits serve`'s flags give once checked: the configs, and the sockets already bound."""

    engine_config: EngineConfig
    server_config: ServerConfig
    api_keys: tuple[str, ...]
    tracer: Any
    security: Any  # ServerSecurity
    tenancy: Tenancy
    sock: socket.socket
    metrics_listener: Any  # MetricsListener | None

    def close(self) -> None:
        """Let go of the sockets (serving never started)."""
        self.sock.close()
        if self.metrics_listener is not None:
            self.metrics_listener.stop()


def check_flags(args: argparse.Namespace) -> CheckedFlags | int:
    """Every flag checked without torch (a GPU's own limits are read after the first line) and the ports
    bound; an int is the exit code (a user error, said in one line; a torchrun worker rank's end)."""
    from sits.runtime.hardware import CPU_DEFAULTS
    from sits.runtime.parallel.ranks import torchrun_rank_info
    from sits.runtime.tenancy.service import Tenancy
    from sits.runtime.tracing import build_tracer

    try:
        engine_config = with_chat_template(engine_config_from_args(args, CPU_DEFAULTS), args)
        server_config = server_config_from_args(args)
        api_keys = api_keys_from_args(args)
        tracer = build_tracer(args.otlp_endpoint)
        security = security_from_args(args)
        tenancy = Tenancy.from_config(tenancy_config_from_args(args))  # reads --tenants; no I/O yet
        rank = torchrun_rank_info()
        if rank is not None and rank.rank != 0:  # torchrun ranks 1..N-1 serve rank 0's steps, not HTTP
            return serve_torchrun_rank(args)
        sock = bind(server_config.host, server_config.port)
        try:
            metrics_listener = bind_metrics_listener(server_config.host, security.metrics_port)
        except SecurityConfigError:
            sock.close()
            raise
    except (ConfigError, TenantConfigError, SecurityConfigError) as error:
        return fail(PROG, str(error))
    return CheckedFlags(engine_config, server_config, api_keys, tracer, security, tenancy, sock, metrics_listener)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    checked = check_flags(args)
    if isinstance(checked, int):
        return checked
    # The first line comes as soon as the flags are checked (within a second): loading takes seconds to
    # minutes, and silence looks like a hang.
    model = checked.engine_config.model
    logger.info("sits serve: loading %s, then serving on %s:%d", model.model or model.config_name
                or "the embedded SmolLM2-135M-Instruct", *checked.sock.getsockname()[:2])
    if not surely_cpu(args.device):  # the GPU's memory and rates pick the limits the flags leave unset (torch)
        try:
            checked.engine_config = with_chat_template(engine_config_from_args(args), args)
        except ConfigError as error:
            checked.close()
            return fail(PROG, str(error))
    from sits.runtime.engine.core_client import MultiprocessEngineClient
    from sits.runtime.server.runner import run_server

    engine = build_engine(checked.engine_config, checked.tenancy, args)
    if isinstance(engine, int):
        checked.close()
        return engine
    app = build_serving_app(engine, checked, args)
    from sits.runtime.gc_heap import frozen_startup_heap

    try:  # full collections would stall streams (gc_heap.py)
        with frozen_startup_heap("sits serve"), serving_metrics(checked.metrics_listener, app):
            return run_server(app, engine, checked.sock, checked.server_config.drain_timeout_s, args.log_level)
    finally:
        checked.tracer.shutdown()  # exports the spans still batched: the last requests' traces are not lost
        if isinstance(engine, MultiprocessEngineClient):  # its process goes, also when the server never started
            engine.close()


def build_serving_app(engine: Any, checked: CheckedFlags, args: argparse.Namespace) -> Any:
    """The FastAPI app around the engine, and the lines that say how it serves."""
    from sits.runtime.server.app import build_app
    from sits.runtime.server.tenant import ApiKeyResolver

    config, tenancy, api_keys = checked.server_config, checked.tenancy, checked.api_keys
    app = build_app(engine, config, served_model_name=checked.engine_config.model.served_model_name,
                    tenancy=tenancy, max_waiting_requests=args.max_waiting_requests,
                    tenant_resolver=ApiKeyResolver(api_keys) if api_keys else None, security=checked.security)
    app.state.ctx.tracer = checked.tracer
    host, port = checked.sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    logger.info("serving %s at http://%s:%d/v1 (track %s)", app.state.ctx.model_name, url_host, port, config.track)
    if app.state.admission is not None:
        logger.info("admission: %d sequences running + %d waiting, then 503 with Retry-After",
                    app.state.admission.max_running, app.state.admission.max_waiting)
    mode = f"api_key ({len(api_keys)} key(s))" if api_keys else tenancy.authenticator.mode.value  # never the keys
    logger.info("tenancy: %s, %d tenant(s), state store %s (deployment %s)", mode, len(tenancy.table),
                redact_url(tenancy.config.state_store), tenancy.config.deployment)
    return app


def engine_in_process(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> bool:
    """--engine-in-process, or $SITS_ENGINE_IN_PROCESS set to 1 / true / yes."""
    flag = environ.get(ENGINE_IN_PROCESS_ENV, "").strip().lower() in {"1", "true", "yes"}
    return bool(getattr(args, "engine_in_process", False)) or flag


def serve_torchrun_rank(args: argparse.Namespace) -> int:
    """A torchrun rank other than 0: the engine's share of every step, with the device's limits; no port."""
    from sits.runtime.parallel.cli_args import run_if_torchrun_worker

    engine_config = with_chat_template(engine_config_from_args(args), args)
    exit_code = run_if_torchrun_worker(engine_config, engine_config.parallel)
    return 0 if exit_code is None else exit_code


def build_engine(engine_config: EngineConfig, tenancy: Tenancy, args: argparse.Namespace) -> Any:
    """The engine `sits serve` serves: in its own process by default, on a thread of this one with
    --engine-in-process; or an exit code after a one-line error."""
    from sits.runtime.commands.loading import load_engine, spawn_engine

    if not engine_in_process(args):
        return spawn_engine(engine_config, PROG, tenancy, args.log_level)
    engine = load_engine(engine_config, PROG, **tenancy.engine_hooks())
    if not isinstance(engine, int):
        engine.add_periodic(tenancy.publish_eviction_index, EVICTION_INDEX_INTERVAL_S)
    return engine
