"""`python -m sits.operator` (and `sits operator`): run the SitsDeployment operator.

It watches SitsDeployments in every namespace, or only in --namespace, against the cluster of
$KUBECONFIG (or the pod's service account), serves the Alertmanager webhook on
--webhook-port (POST /alertmanager, with the bearer token of --webhook-token-file or
$SITS_WEBHOOK_TOKEN; without one it does not listen), and liveness (GET /healthz) and Prometheus metrics
(GET /metrics) on --health-port. SIGTERM / Ctrl-C stop it cleanly.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from sits.operator.config import OperatorConfig
from sits.operator.webhook_auth import TOKEN_ENV, token_from

DEFAULTS = OperatorConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", default=None, help="watch only this namespace (default: all)")
    parser.add_argument("--listen-host", default=DEFAULTS.listen_host,
                        help="the address the webhook and the health endpoint listen on")
    parser.add_argument("--webhook-port", type=int, default=DEFAULTS.webhook_port,
                        help="the Alertmanager receiver's port (POST /alertmanager); 0 turns it off")
    parser.add_argument("--webhook-token-file", default=None, metavar="PATH",
                        help=f"the bearer token Alertmanager must send (default: ${TOKEN_ENV}); re-read when it changes")
    parser.add_argument("--webhook-allow-unauthenticated", action="store_true",
                        help="serve the webhook without a token: anyone reaching it can roll back canaries")
    parser.add_argument("--health-port", type=int, default=DEFAULTS.health_port,
                        help="liveness (GET /healthz) and Prometheus metrics (GET /metrics) port; 0 turns it off")
    parser.add_argument("--resync-interval", type=float, default=DEFAULTS.resync_interval_s, metavar="SECONDS",
                        help="reconcile every resource this often (the clock of pauses and analysis)")
    parser.add_argument("--tenancy-interval", type=float, default=DEFAULTS.tenancy_interval_s, metavar="SECONDS",
                        help="check tenant tables in Redis this often")
    parser.add_argument("--peering", default=None, help="kopf peering name, to run several replicas (default: standalone)")
    parser.add_argument("--verbose", action="store_true", help="log every reconcile step")
    parser.add_argument("--debug", action="store_true", help="log kopf's internals too")


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    """The OperatorConfig of these flags (and $SITS_WEBHOOK_TOKEN); ValueError names a bad one."""
    for flag, value in (("--webhook-port", args.webhook_port), ("--health-port", args.health_port)):
        if not 0 <= value <= 65535:
            raise ValueError(f"{flag} must be between 0 and 65535, got {value}")
    for flag, value in (("--resync-interval", args.resync_interval), ("--tenancy-interval", args.tenancy_interval)):
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    token_file, token = args.webhook_token_file, os.environ.get(TOKEN_ENV) or None
    return OperatorConfig(namespace=args.namespace, listen_host=args.listen_host, webhook_port=args.webhook_port,
                          webhook_token_file=token_file, webhook_token=token,
                          webhook_allow_unauthenticated=args.webhook_allow_unauthenticated,
                          resync_interval_s=args.resync_interval, tenancy_interval_s=args.tenancy_interval,
                          health_port=args.health_port, peering=args.peering)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        token_from(config.webhook_token_file, config.webhook_token)  # an unusable token fails now, not at startup
    except ValueError as error:
        print(f"sits operator: error: {error}", file=sys.stderr)
        return 2
    import kopf

    from sits.operator.handlers import register

    kopf.configure(verbose=args.verbose, debug=args.debug)
    if not (args.verbose or args.debug):
        # kopf logs every timer tick ("Timer 'resync' succeeded"); the operator logs what changed
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    registry = kopf.OperatorRegistry()
    register(registry, config)
    kopf.run(
        registry=registry,
        clusterwide=config.namespace is None,
        namespaces=[config.namespace] if config.namespace else (),
        standalone=config.peering is None,
        peering_name=config.peering,
    )  # the health server (kopf's liveness endpoint could not serve /metrics too) starts with the handlers
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `sits operator` subcommand (for sits.runtime.cli's COMMANDS registry)."""
    parser = subparsers.add_parser("operator", help="run the SitsDeployment operator",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(handler=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sits.operator", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
