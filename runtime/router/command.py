"""`sits router` (and `python -m sits.runtime.router`): the router's flags and its main.

    sits router --replica http://10.0.0.1:8000 --replica http://10.0.0.2:8000 \\
        --state-store redis://sits-redis:6379/0 --deployment llama3-8b --tenants tenants.yaml \\
        [--policy precise|approximate|least-loaded|round-robin] [--weights prefix=1,running=0.08,...] \\
        [--model PATH --chat-template T --served-model-name NAME --block-size N] \\
        [--canary-weight PERCENT --canary-tenants NAME,...] [--host H --port P]
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from collections.abc import Sequence

from sits.runtime.config import CacheConfig, ConfigError
from sits.runtime.router.config import Policy, RouterConfig, ScoringWeights
from sits.runtime.server.http_limits import HttpLimits, uvicorn_options
from sits.runtime.tenancy.state_store import redact_url
from sits.runtime.tenancy.tenants import TenantConfigError

PROG = "sits router"
log = logging.getLogger("sits.router")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("router", help="route requests across replicas by tenant prefix cache and load",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="a replica's base URL (repeat for each replica)")
    parser.add_argument("--discover", action="append", default=[], metavar="NAMESPACE/SERVICE",
                        help="a Service whose ready endpoints are replicas (its EndpointSlices; repeat for "
                             "stable and canary)")
    parser.add_argument("--replica-metrics-port", type=int, default=None, metavar="PORT",
                        help="the replicas' --metrics-port: their /metrics is read there (default: their API port)")
    parser.add_argument("--kube-api", default=None, metavar="URL",
                        help="the Kubernetes API for --discover (default: in-cluster)")
    parser.add_argument("--state-store", default="memory://", metavar="URL",
                        help="the replicas' --state-store (redis://host:port/db): their KV state and tenant table")
    parser.add_argument("--deployment", default="default", metavar="NAME", help="the replicas' --deployment")
    parser.add_argument("--tenants", default=None, metavar="FILE", help="the replicas' --tenants file")
    parser.add_argument("--policy", default=Policy.PRECISE.value, choices=[p.value for p in Policy])
    parser.add_argument("--weights", default="", metavar="NAME=VALUE,...",
                        help="score weights: prefix, running, waiting, kv, imbalance (see docs/router.md)")
    parser.add_argument("--model", default=None, help="the replicas' --model (default: the embedded SmolLM2)")
    parser.add_argument("--chat-template", default=None, help="the replicas' --chat-template")
    parser.add_argument("--served-model-name", default=None,
                        help="the replicas' base model id (other model ids are adapters)")
    parser.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="the replicas' --block-size")
    parser.add_argument("--canary-weight", type=int, default=0, metavar="PERCENT",
                        help="percent of requests for replicas of track canary (without a Gateway API)")
    parser.add_argument("--canary-tenants", default="", metavar="NAME,...",
                        help="tenants whose requests all go to the canary while one is up")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--http-header-timeout", type=float, default=15.0, metavar="SECONDS",
                        help="a client must send a request's complete headers within this (then 408 and close), "
                             "as sits serve does (docs/security.md)")
    parser.add_argument("--http-body-min-rate", type=float, default=1024.0, metavar="BYTES_PER_S",
                        help="a request body slower than this is closed")
    parser.add_argument("--http-max-connections", type=int, default=None, metavar="N",
                        help="open connections at most; past them 503 and close (default: from the descriptor limit)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(replicas=list(args.replica), state_store=args.state_store, deployment=args.deployment,
                        tenants_file=args.tenants, policy=Policy(args.policy),
                        weights=ScoringWeights.parse(args.weights), model=args.model,
                        chat_template=args.chat_template, served_model_name=args.served_model_name,
                        block_size=args.block_size, host=args.host, port=args.port,
                        canary_weight=args.canary_weight,
                        canary_tenants=tuple(t.strip() for t in args.canary_tenants.split(",") if t.strip()),
                        discover=tuple(args.discover), kube_api=args.kube_api,
                        replica_metrics_port=args.replica_metrics_port)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from sits.runtime.router.app import build_app, build_router_state
    from sits.runtime.router.prompt import PromptHasher, load_tokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    try:
        config = config_from_args(args)
        config.validate()
        hasher = PromptHasher(load_tokenizer(config.model, config.chat_template), config.block_size,
                              config.served_model_name)
        limits = http_limits_from_args(args)
        state = build_router_state(config, hasher)
        sock = socket.create_server((config.host, config.port), family=_family(config.host), reuse_port=False)
    except (ConfigError, TenantConfigError, OSError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    log.info("router: policy %s over %d replica(s), state store %s (deployment %s); listening on http://%s:%d",
             config.policy.value, len(config.replicas), redact_url(config.state_store), config.deployment, host, port)
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level=args.log_level, access_log=False,
                                           timeout_graceful_shutdown=5, **uvicorn_options(limits)))
    server.run(sockets=[sock])
    return 0


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """The same read timeouts and connection cap as `sits serve` (`sits.runtime.server.http_limits`);
    ValueError for a bad value."""
    cap = {} if args.http_max_connections is None else {"max_connections": args.http_max_connections}
    limits = HttpLimits(header_timeout_s=args.http_header_timeout, body_min_rate=args.http_body_min_rate, **cap)
    limits.validate()
    return limits


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
