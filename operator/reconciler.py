"""One reconcile of one SitsDeployment: read, decide, build, apply, write status.

Every trigger (kopf's create/update/resume handlers, the resync timer, the Alertmanager webhook)
calls `Reconciler.reconcile`, which re-reads the resource under a per-resource lock: two triggers
never act on a stale copy, and running it twice in a row changes nothing the second time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sits.operator.analysis import ProviderRegistry, run_analysis
from sits.operator.builders import OPTIONAL_KINDS, PRUNED_KINDS, build_all
from sits.operator.fields import SpecError
from sits.operator.kube import ApiError, KubeClient, digest
from sits.operator.meta import (
    API_VERSION,
    DEPLOYMENT_LABEL,
    KIND,
    RESUME_ANNOTATION,
    Owner,
    deployment_name,
    is_owned_by,
)
from sits.operator.observations import DeploymentObservation, ManualCommands, Observations
from sits.operator.rollout import analysis_due, decide
from sits.operator.spec import SitsDeploymentSpec, TenancySpec, parse_spec
from sits.operator.stats import RolloutStats
from sits.operator.status import Status, status_patch, to_timestamp
from sits.operator.tenancy_sync import sync_tenant_table
from sits.operator.tenants import TenantRecord, resolve_tenants

logger = logging.getLogger("sits.operator")

OPTIONAL_KIND_NAMES = {kind for _, kind in OPTIONAL_KINDS}  # a 404 on apply: the CRD is not installed
PRUNED_KIND_NAMES = {kind for _, kind in PRUNED_KINDS}


@dataclass
class _Applied:
    """What this process last applied for one resource (digests of the built objects)."""

    checked_at: float
    digests: dict[tuple[str, str], str] = field(default_factory=dict)
    optional: frozenset[tuple[str, str]] = frozenset()
    tenancy: TenancySpec | None = None
    tenants: list[TenantRecord] = field(default_factory=list)


@dataclass(frozen=True)
class ReconcileResult:
    phase: str | None
    error: SpecError | None = None  # the spec is invalid (kopf handlers raise PermanentError)
    gone: bool = False


class Reconciler:
    def __init__(self, kube: KubeClient, providers: ProviderRegistry | None = None,
                 clock: Callable[[], float] = time.time, drift_check_s: float = 60.0) -> None:
        """`drift_check_s`: how often every owned object is read back even when nothing changed
        (someone may have edited or deleted it); between those, only what changed is applied."""
        self.kube = kube
        self.providers = providers or ProviderRegistry()
        self.clock = clock
        self.drift_check_s = drift_check_s
        self._locks: dict[tuple[str, str], threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._applied: dict[tuple[str, str], _Applied] = {}
        self.stats = RolloutStats()  # what each reconcile decided, for the metrics to read

    def lock(self, namespace: str, name: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.RLock())

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted resource's memo and statistics (after a reconcile in flight has finished)."""
        with self.lock(namespace, name):
            self.stats.forget(namespace, name)
            with self._locks_guard:
                self._locks.pop((namespace, name), None)
                self._applied.pop((namespace, name), None)

    def _get(self, namespace: str, name: str) -> dict[str, Any] | None:
        body = self.kube.get(API_VERSION, KIND, namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return None
        return body

    def reconcile(self, namespace: str, name: str) -> ReconcileResult:
        """Raises ApiError when the Kubernetes API fails (counted in stats; the next trigger retries)."""
        try:
            return self._reconcile(namespace, name)
        except Exception:
            self.stats.record_error()
            raise

    def _reconcile(self, namespace: str, name: str) -> ReconcileResult:
        with self.lock(namespace, name):
            body = self._get(namespace, name)
            if body is None:
                self.stats.forget(namespace, name)
                return ReconcileResult(phase=None, gone=True)
            owner = Owner.from_body(body)
            stored = body.get("status") or {}
            try:
                spec = parse_spec(body.get("spec"), name)
            except SpecError as error:
                self._report_invalid(owner, stored, error)
                return ReconcileResult(phase="Degraded", error=error)
            status = Status.from_dict(stored)
            obs = self._observe(body, owner)
            now = self.clock()
            analysis = spec.rollout.canary.analysis
            if analysis is not None and analysis_due(spec, owner, status, now):
                outcome = run_analysis(self.providers.for_analysis(analysis), owner, analysis)
                logger.info("analysis of %s/%s: %s", namespace, name, outcome.message)
                obs = replace(obs, analysis=outcome)
                now = self.clock()
            decision = decide(spec, owner, status, obs, now)
            self._apply(owner, spec, decision.plan, decision.status, now, obs)
            consumed = decision.annotations_to_remove()
            if consumed:
                # Before the status: a crash in between loses a command rather than running it twice
                self.kube.patch(API_VERSION, KIND, namespace, name,
                                {"metadata": {"annotations": dict.fromkeys(consumed)}})
            patch = status_patch(stored, decision.status)
            if patch:
                self.kube.patch(API_VERSION, KIND, namespace, name, {"status": patch}, subresource="status")
            for event in decision.events:
                logger.info("%s/%s %s: %s", namespace, name, event.reason, event.message)
                self.kube.post_event(owner, event.type, event.reason, event.message)
            # After the status is written: a reconcile that failed before is decided (and counted) again
            self.stats.record(namespace, name, decision.status, (event.reason for event in decision.events))
            return ReconcileResult(phase=decision.status.phase)

    def _observe(self, body: dict[str, Any], owner: Owner) -> Observations:
        meta = body.get("metadata", {})
        tracks = [DeploymentObservation.from_object(
            self.kube.get("apps/v1", "Deployment", owner.namespace, deployment_name(owner.name, track)))
            for track in ("stable", "canary")]
        generation = meta.get("generation")
        annotations = meta.get("annotations") or {}
        return Observations(stable=tracks[0], canary=tracks[1],
                            generation=generation if isinstance(generation, int) else None,
                            resume_requested=RESUME_ANNOTATION in annotations,
                            commands=ManualCommands.from_annotations(annotations))

    def _apply(self, owner: Owner, spec: SitsDeploymentSpec, plan: Any, status: Status, now: float,
               obs: Observations) -> None:
        """Apply what changed since the last apply; everything (and cleanup) once per drift check."""
        key = (owner.namespace, owner.name)
        memo = self._applied.get(key)
        if memo is None or now - memo.checked_at >= self.drift_check_s or not (obs.stable.exists and obs.canary.exists):
            memo = _Applied(checked_at=now)  # a full pass: read every object back, catch drift
        full = not memo.digests
        tenants = None
        if spec.tenancy.tenants:
            if memo.tenancy != spec.tenancy:
                memo.tenancy = spec.tenancy
                memo.tenants = resolve_tenants(spec.tenancy, self._secret_reader(owner.namespace)).records
            tenants = memo.tenants
        wanted: set[tuple[str, str]] = set()
        missing_kinds: list[str] = []
        for obj in build_all(owner, spec, plan, tenants):
            name = (obj["kind"], obj["metadata"]["name"])
            wanted.add(name)
            built = digest(obj)
            if memo.digests.get(name) == built:
                continue
            try:
                outcome = self.kube.apply(obj)
            except ApiError as error:
                if error.status == 404 and obj["kind"] in OPTIONAL_KIND_NAMES:
                    missing_kinds.append(obj["kind"])  # its CRD is not installed
                    continue
                raise
            memo.digests[name] = built
            if outcome != "unchanged":
                logger.info("%s %s %s/%s", outcome, obj["kind"], owner.namespace, obj["metadata"]["name"])
        optional = frozenset(n for n in wanted if n[0] in PRUNED_KIND_NAMES)
        if full or optional != memo.optional:
            self._delete_unwanted(owner, wanted)
            memo.optional = optional
        self._applied[key] = memo
        if missing_kinds:
            status.set_condition("ResourcesReady", False, "CRDMissing",
                                 f"cannot create {', '.join(missing_kinds)}: the CRD is not installed", now)
        else:
            status.remove_condition("ResourcesReady")

    def _delete_unwanted(self, owner: Owner, wanted: set[tuple[str, str]]) -> None:
        """Delete optional (and router) objects this resource owns and the spec no longer asks for."""
        for api_version, kind in PRUNED_KINDS:
            try:
                existing = self.kube.list(api_version, kind, owner.namespace, f"{DEPLOYMENT_LABEL}={owner.name}")
            except ApiError as error:
                if error.status == 404:
                    continue
                raise
            for obj in existing:
                name = obj.get("metadata", {}).get("name")
                if name and is_owned_by(obj, owner) and (kind, name) not in wanted:
                    self.kube.delete(api_version, kind, owner.namespace, name)
                    logger.info("deleted %s %s/%s", kind, owner.namespace, name)

    def _secret_reader(self, namespace: str) -> Callable[[str], dict[str, str] | None]:
        def read(name: str) -> dict[str, str] | None:
            secret = self.kube.get("v1", "Secret", namespace, name)
            return None if secret is None else (secret.get("data") or {})
        return read

    def _report_invalid(self, owner: Owner, stored: dict[str, Any], error: SpecError) -> None:
        status = Status.from_dict(stored)
        now = self.clock()
        was = status.condition("InvalidSpec")
        status.set_condition("InvalidSpec", True, "InvalidSpec", str(error), now)
        if status.phase is None:
            status.phase = "Degraded"
        patch = status_patch(stored, status)
        if patch:
            self.kube.patch(API_VERSION, KIND, owner.namespace, owner.name, {"status": patch}, subresource="status")
        if was is None or was.get("message") != str(error):
            self.kube.post_event(owner, "Warning", "InvalidSpec", str(error))
        self.stats.record(owner.namespace, owner.name, status)

    # -- Alertmanager ---------------------------------------------------------------------------

    def request_abort(self, namespace: str, name: str, reason: str, message: str, started_at: float) -> str:
        """Abort this resource's running canary (an alert that started firing at `started_at`, Unix
        seconds); returns what was done, in words. An alert older than the canary is ignored."""
        with self.lock(namespace, name):
            body = self._get(namespace, name)
            if body is None:
                return "ignored: no such SitsDeployment"
            status = Status.from_dict(body.get("status"))
            if status.canary_revision is None or status.phase not in ("Progressing", "Paused"):
                return "ignored: no canary is running"
            if status.canary_started_at is not None and started_at < status.canary_started_at:
                return "ignored: the alert started firing before this canary started"
            request = {"revision": status.canary_revision, "reason": reason, "message": message,
                       "requestedAt": to_timestamp(self.clock())}
            self.kube.patch(API_VERSION, KIND, namespace, name, {"status": {"abortRequest": request}},
                            subresource="status")
            self.reconcile(namespace, name)
            return f"aborted canary {status.canary_revision}"

    # -- tenancy --------------------------------------------------------------------------------

    def sync_tenants(self, namespace: str, name: str) -> None:
        """Hash the tenants' keys and write the tenant table to Redis; report in status.tenancy."""
        body = self._get(namespace, name)
        if body is None:
            return
        try:
            spec = parse_spec(body.get("spec"), name)
        except SpecError:
            return  # reconcile reports it
        stored = (body.get("status") or {}).get("tenancy")
        if not spec.tenancy.tenants:
            if stored is not None:
                self.kube.patch(API_VERSION, KIND, namespace, name, {"status": {"tenancy": None}},
                                subresource="status")
            return
        resolution = resolve_tenants(spec.tenancy, self._secret_reader(namespace))
        if spec.tenancy.redis_url:
            result = sync_tenant_table(spec.tenancy.redis_url, namespace, name, resolution.records)
            synced, reason, message = result.synced, result.reason, result.message
        else:
            synced, reason, message = True, "ConfigMapOnly", "no spec.tenancy.redis: pods read the ConfigMap's file"
        if resolution.problems:
            synced, reason = False, "SecretsMissing" if synced else reason
            message = "; ".join(resolution.problems) + "; " + message
        tenancy = {"synced": synced, "reason": reason, "message": message,
                   "tenants": len(resolution.records), "digest": resolution.digest()}
        memo = self._applied.get((namespace, name))
        if memo is not None and memo.tenants != resolution.records:
            memo.tenancy = None  # a Secret changed: the next reconcile rebuilds the tenants file
        if stored != tenancy:
            self.kube.patch(API_VERSION, KIND, namespace, name, {"status": {"tenancy": tenancy}},
                            subresource="status")
