"""Thin kopf handlers: each one calls the Reconciler, which reads, builds, applies and writes status.

`register(registry, config)` installs them into a kopf registry (so tests and `python -m
sits.operator` each get their own, configured the same way):

- create / update / resume: reconcile now; an invalid spec raises kopf.PermanentError (the
  status already carries an InvalidSpec condition naming the field);
- a timer every `resync_interval_s`: reconcile (pauses, readiness waits and analysis runs are
  decided on these ticks);
- a timer every `tenancy_interval_s`: write the tenant table to Redis;
- delete: forget the resource (its metrics series go) and delete its tenant table from Redis;
- startup / cleanup: settings, the API client, the health server (`/healthz`, `/metrics`) and
  the Alertmanager webhook (only with a bearer token, or explicitly unauthenticated).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import kopf

from sits.operator.config import OperatorConfig
from sits.operator.health import start_health_server
from sits.operator.kube import KubeClient
from sits.operator.meta import GROUP, PLURAL, VERSION
from sits.operator.metrics import build_registry
from sits.operator.reconciler import Reconciler
from sits.operator.spec import parse_spec
from sits.operator.tenancy_sync import delete_tenant_table
from sits.operator.webhook import start_configured_webhook

RESOURCE = (GROUP, VERSION, PLURAL)


@dataclass
class OperatorState:
    """What startup creates and every handler shares."""

    reconciler: Reconciler | None = None
    webhook: Any = None
    health: Any = None

    def require(self) -> Reconciler:
        if self.reconciler is None:
            raise kopf.TemporaryError("the operator is still starting", delay=1)
        return self.reconciler


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> OperatorState:
    """Install the operator's handlers into `registry`; returns the state they share."""
    state = OperatorState()
    _register_lifecycle(registry, config, state)
    _register_resource(registry, config, state)
    return state


def _configure(settings: kopf.OperatorSettings) -> None:
    # Our own annotations, not kopf.zalando.org/*; status.kopf would be pruned by the CRD schema
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="sits.ai")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="sits.ai", key="last-handled-configuration")
    # Handler failures (a PermanentError for an invalid spec) become Warning/Error Events; the
    # rollout's own Events are posted by the reconciler
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60


def _register_lifecycle(registry: kopf.OperatorRegistry, config: OperatorConfig, state: OperatorState) -> None:
    """Login, startup (settings, API client, health server, webhook) and cleanup."""

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(id="startup", registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        _configure(settings)
        if state.reconciler is None:  # kopf retries a failed startup: keep what the last try made
            state.reconciler = Reconciler(KubeClient.from_environment())
        if config.health_port and state.health is None:
            state.health = await start_health_server(build_registry(state.reconciler.stats.snapshot),
                                                     config.listen_host, config.health_port)
        if state.webhook is None:
            state.webhook = await start_configured_webhook(state.reconciler, config)

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(**_: Any) -> None:
        for server in ("webhook", "health"):
            if getattr(state, server) is not None:
                await getattr(state, server).cleanup()
                setattr(state, server, None)
        if state.reconciler is not None:
            state.reconciler.providers.terminate_all()
            state.reconciler.kube.close()


def _register_resource(registry: kopf.OperatorRegistry, config: OperatorConfig, state: OperatorState) -> None:
    """The SITSDeployment handlers: reconcile on change, resync and tenant timers, deletion."""
    backoff = max(config.resync_interval_s, 0.5)

    @kopf.on.resume(*RESOURCE, id="reconcile", registry=registry, backoff=backoff)
    @kopf.on.create(*RESOURCE, id="reconcile", registry=registry, backoff=backoff)
    @kopf.on.update(*RESOURCE, id="reconcile", registry=registry, backoff=backoff)
    def reconcile(name: str, namespace: str, **_: Any) -> None:
        result = state.require().reconcile(namespace, name)
        if result.error is not None:
            raise kopf.PermanentError(str(result.error))

    @kopf.timer(*RESOURCE, id="resync", registry=registry, interval=config.resync_interval_s, backoff=backoff,
                errors=kopf.ErrorsMode.IGNORED)
    def resync(name: str, namespace: str, **_: Any) -> None:
        state.require().reconcile(namespace, name)

    @kopf.timer(*RESOURCE, id="tenants", registry=registry, interval=config.tenancy_interval_s, backoff=backoff,
                errors=kopf.ErrorsMode.IGNORED)
    def sync_tenants(name: str, namespace: str, **_: Any) -> None:
        state.require().sync_tenants(namespace, name)

    @kopf.on.delete(*RESOURCE, id="cleanup", registry=registry, optional=True)
    def deleted(name: str, namespace: str, spec: Any, **_: Any) -> None:
        # Owned objects go with the resource (owner references); only Redis needs cleaning up. The
        # timers put kopf's finalizer on every resource, so this runs even for a deletion made while
        # the operator was down (once it is back)
        if state.reconciler is not None:
            state.reconciler.forget(namespace, name)
        try:
            tenancy = parse_spec(dict(spec), name).tenancy
        except ValueError:
            return
        if tenancy.redis_url:
            delete_tenant_table(tenancy.redis_url, namespace, name)
