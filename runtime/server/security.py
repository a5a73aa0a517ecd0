"""The server's security settings: one object built from `sits serve`'s flags, read by the app.

Each part is owned by its module: grammar-compile bounds (`limits_config.GrammarLimits`, enforced
by `grammar_compiler`), HTTP read timeouts and the connection cap (`limits_config.HttpLimits`,
enforced by `http_limits`), the metrics listener (`metrics_access`), the LoRA roots (`sits.runtime.lora.roots`). The request-size limits of
the protocol (stop strings, bad_words) are constants of `input_limits`. docs/security.md lists
them all with their values.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sits.runtime.server.limits_config import GrammarLimits, HttpLimits

if TYPE_CHECKING:
    from sits.runtime.server.metrics_access import MetricsListener

logger = logging.getLogger("sits.server")


class SecurityConfigError(ValueError):
    """A security flag out of range (the message names it)."""


@dataclass(frozen=True)
class ServerSecurity:
    """What `sits serve`'s security flags set.

    Attributes:
        grammar: bounds of structured-output grammar compiles.
        http: header/body read timeouts and the connection cap of the HTTP server.
        metrics_port: serve /metrics on this port only (a second listener); None: on the API
            port (in tenants mode there only for an admin tenant's key).
        lora_roots: directories local LoRA adapters may be loaded from (resolved); none: only
            hf:// ids load at runtime.
        api_docs: serve /docs, /redoc and /openapi.json; None: yes, except in tenants mode.
    """

    grammar: GrammarLimits = field(default_factory=GrammarLimits)
    http: HttpLimits = field(default_factory=HttpLimits)
    metrics_port: int | None = None
    lora_roots: tuple[Path, ...] = ()
    api_docs: bool | None = None


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (docs/security.md)")
    grammar, http = GrammarLimits(), HttpLimits()
    group.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus /metrics on this port only, on --host (default: on the API port; "
                            "with --tenants there only for an admin tenant's key)")
    group.add_argument("--lora-root", action="append", default=None, metavar="DIR",
                       help="a directory runtime-loaded LoRA adapters may come from (repeatable); local paths "
                            "outside every root are refused (default: none, so only hf:// ids load)")
    group.add_argument("--enable-api-docs", action=argparse.BooleanOptionalAction, default=None,
                       help="serve /docs, /redoc and /openapi.json (default: yes, except with --tenants)")
    group.add_argument("--grammar-max-depth", type=int, default=grammar.max_depth, metavar="LEVELS",
                       help="nesting levels a structured-output schema, regex or grammar may have")
    group.add_argument("--grammar-max-bytes", type=int, default=grammar.max_bytes, metavar="BYTES",
                       help="size of a structured-output schema, regex, grammar or choice list")
    group.add_argument("--grammar-compile-timeout", type=float, default=grammar.compile_timeout_s,
                       metavar="SECONDS", help="a grammar still compiling after this long is a 400 (its worker "
                                               "process is killed)")
    group.add_argument("--grammar-compile-workers", type=int, default=grammar.workers, metavar="N",
                       help="grammar-compile worker processes")
    group.add_argument("--grammar-compiles-per-tenant", type=int, default=grammar.per_tenant, metavar="N",
                       help="grammar compiles one tenant may run at once (its others wait their turn)")
    group.add_argument("--grammar-compile-queue-per-tenant", type=int, default=grammar.queue_per_tenant,
                       metavar="N", help="grammar compiles of one tenant that may wait for their turn; beyond: 429")
    group.add_argument("--http-header-timeout", type=float, default=http.header_timeout_s, metavar="SECONDS",
                       help="a connection must send a request's complete headers within this long")
    group.add_argument("--http-body-min-rate", type=float, default=http.body_min_rate, metavar="BYTES_PER_S",
                       help="a request body must arrive at least this fast (after --http-header-timeout of grace)")
    group.add_argument("--http-max-connections", type=int, default=http.max_connections, metavar="N",
                       help="open connections at most; beyond them requests get 503 and new connections are "
                            "closed")


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """The ServerSecurity of parsed flags; SecurityConfigError naming the flag that is out of range."""
    grammar = GrammarLimits(max_depth=args.grammar_max_depth, max_bytes=args.grammar_max_bytes,
                            compile_timeout_s=args.grammar_compile_timeout, workers=args.grammar_compile_workers,
                            per_tenant=args.grammar_compiles_per_tenant,
                            queue_per_tenant=args.grammar_compile_queue_per_tenant)
    http = HttpLimits(header_timeout_s=args.http_header_timeout, body_min_rate=args.http_body_min_rate,
                      max_connections=args.http_max_connections)
    try:
        grammar.validate()
        http.validate()
    except ValueError as error:
        raise SecurityConfigError(f"--grammar-*/--http-* flags: {error}") from None
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        raise SecurityConfigError(f"--metrics-port must be a TCP port, got {args.metrics_port}")
    roots = tuple(Path(root).expanduser().resolve() for root in args.lora_root or ())
    missing = [str(root) for root in roots if not root.is_dir()]
    if missing:
        raise SecurityConfigError(f"--lora-root {missing[0]} is not a directory")
    return ServerSecurity(grammar=grammar, http=http, metrics_port=args.metrics_port, lora_roots=roots,
                          api_docs=args.enable_api_docs)


def bind_metrics_listener(host: str, port: int | None) -> MetricsListener | None:
    """The --metrics-port listener, bound (not serving yet); None without the flag.

    Raises SecurityConfigError when the port cannot be bound (before the model loads, like the API port)."""
    if port is None:
        return None
    from sits.runtime.server.metrics_access import MetricsListener

    try:
        return MetricsListener(host, port)
    except OSError as error:
        raise SecurityConfigError(f"--metrics-port: cannot listen on {host}:{port}: {error.strerror or error}") from None


@contextlib.contextmanager
def serving_metrics(listener: MetricsListener | None, app: Any) -> Iterator[None]:
    """`app`'s /metrics on the listener while the block runs (nothing without a listener); closed after."""
    if listener is None:
        yield
        return
    listener.start(app.state.metrics.exposition)
    logger.info("metrics at http://%s:%d/metrics (not on the API port)", listener.host, listener.port)
    try:
        yield
    finally:
        listener.stop()
