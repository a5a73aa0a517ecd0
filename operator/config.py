"""How the operator process runs (flags of `python -m sits.operator`); not per-resource settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    """Attributes:
        namespace: watch only this namespace (None: all namespaces).
        listen_host: the address the webhook and the health server listen on.
        webhook_port: the Alertmanager receiver (`POST /alertmanager`); 0 turns it off.
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
    resync_interval_s: float = 5.0
    tenancy_interval_s: float = 30.0
    health_port: int = 8080
    peering: str | None = None
