"""How the operator process runs (flags of `python -m sits.operator`); not per-resource settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OperatorConfig:
    """Attributes:
        namespace: watch only this namespace (None: all namespaces).
        listen_host: the address the webhook and the health server listen on.
        webhook_port: the Alertmanager receiver (`POST /alertmanager`); 0 turns it off.
        webhook_token_file: a file holding the bearer token the receiver requires (re-read when it changes).
        webhook_token: the token itself (`$SITS_WEBHOOK_TOKEN`), when no file is given; not in repr.
        webhook_allow_unauthenticated: serve the receiver without a token; without this and without a
            token the receiver does not listen.
        resync_interval_s: how often every resource is reconciled even without changes: the clock of
            pauses, readiness waits and analysis runs (their own intervals are multiples of it).
        tenancy_interval_s: how often tenant tables are checked against Redis (written when changed).
        health_port: the health server: liveness (`GET /healthz`) and Prometheus metrics (`GET /metrics`);
            0 turns it off.
        peering: kopf peering name for running several replicas (None: standalone).
    """

    namespace: str | None = None
    listen_host: str = "0.0.0.0"
    webhook_port: int = 8081
    webhook_token_file: str | None = None
    webhook_token: str | None = field(default=None, repr=False)
    webhook_allow_unauthenticated: bool = False
    resync_interval_s: float = 5.0
    tenancy_interval_s: float = 30.0
    health_port: int = 8080
    peering: str | None = None
