"""The rollout state machine over status.phase, as one pure function.

`decide(spec, owner, status, observations, now)` returns the new status, the plan (which template
and how many replicas each track runs, and the canary's traffic weight) and the Events to post.
It never talks to the cluster and keeps no state of its own: everything it needs to continue, for
instance after an operator restart, is in the status it is given.

Lifecycle: the first revision becomes stable directly (Pending, then Healthy once ready). A new
pod-template revision starts a canary at step 0; each `setWeight` step waits until the canary's
pods are ready and an analysis run passed after the step began; a `pause` waits for its duration
(or, with none, for a resume). Past the last step the stable Deployment takes the canary's template,
and once it is ready the canary scales to 0 (Healthy). `failureLimit` failed analysis runs in a row,
or an alert, abort: weight 0, canary at 0 replicas, RolledBack, until the template changes again.
The manual commands (rollout_commands.py) abort (the same path, phase Degraded), promote at once,
or retry an aborted canary from step 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sits.operator.fields import SpecError
from sits.operator.meta import ABORT_ANNOTATION, DEPLOYMENT_LABEL, RESUME_ANNOTATION, Owner
from sits.operator.observations import Observations
from sits.operator.plan import Plan, TrackPlan
from sits.operator.replicas import canary_replicas, stable_replicas
from sits.operator.revisions import revision_of
from sits.operator.rollout_analysis import PAUSE_INCONCLUSIVE, analysis_due, passed_since, record_analysis
from sits.operator.rollout_commands import ABORTED, CommandInbox, aborted_by_hand, pause_hint, retry_hint
from sits.operator.spec import SitsDeploymentSpec, WorkloadSpec, parse_workload
from sits.operator.status import AnalysisState, Status

__all__ = ["PAUSE_INCONCLUSIVE", "PAUSE_STEP", "Decision", "RolloutEvent", "analysis_due", "decide"]

PAUSE_STEP = "CanaryPauseStep"


@dataclass(frozen=True)
class RolloutEvent:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    status: Status
    plan: Plan
    events: tuple[RolloutEvent, ...] = ()
    consume_resume: bool = False  # remove the sits.ai/resume annotation: it has been acted on
    consumed_commands: tuple[str, ...] = ()  # the other command annotations to remove (acted on or refused)

    def annotations_to_remove(self) -> tuple[str, ...]:
        return (RESUME_ANNOTATION,) * self.consume_resume + self.consumed_commands


@dataclass
class _Context:
    spec: SitsDeploymentSpec
    owner: Owner
    obs: Observations
    now: float
    stored: Status  # as read: tells a pause the operator set from one a user lifted
    status: Status
    stable_workload: WorkloadSpec
    desired_revision: str
    events: list[RolloutEvent] = field(default_factory=list)
    consume_resume: bool = False

    def event(self, kind: str, reason: str, message: str) -> None:
        self.events.append(RolloutEvent(kind, reason, message))


def decide(spec: SitsDeploymentSpec, owner: Owner, status: Status, obs: Observations, now: float) -> Decision:
    s = status.copy()
    s.observed_generation = obs.generation
    s.selector = f"{DEPLOYMENT_LABEL}={owner.name}"
    s.remove_condition("InvalidSpec")
    ctx = _Context(spec=spec, owner=owner, obs=obs, now=now, stored=status, status=s,
                   stable_workload=_stable_workload(s, spec, owner),
                   desired_revision=revision_of(owner, spec.workload))
    commands = CommandInbox(obs.commands, ctx.event)
    if ctx.desired_revision == s.stable_revision:
        plan = _steady(ctx)
    elif ctx.desired_revision == s.aborted_revision and not commands.retry(s, ctx.desired_revision):
        plan = _rolled_back(ctx)
    else:
        if s.canary_revision != ctx.desired_revision:
            _start_canary(ctx)  # a new template, or a retry: step 0
        if commands.abort(s):
            plan = _abort(ctx, ABORTED, f"{ABORT_ANNOTATION} was set; all traffic is back on stable revision "
                                        f"{s.stable_revision}")
        else:
            commands.promote_full(s, len(spec.rollout.canary.steps))
            plan = _progress(ctx)
    commands.refuse_the_rest(s, ctx.desired_revision)
    if obs.resume_requested and not ctx.consume_resume and s.canary_revision is None:
        ctx.consume_resume = True  # nothing to resume: drop it so it cannot skip a later pause
    s.replicas = obs.stable.status_replicas + obs.canary.status_replicas
    s.ready_replicas = obs.stable.ready_replicas + obs.canary.ready_replicas
    s.ready = f"{s.ready_replicas}/{plan.stable.replicas + plan.canary.replicas}"  # both tracks, as planned
    healthy = s.phase == "Healthy"
    s.set_condition("Healthy", healthy, "Ready" if healthy else s.phase or "Pending",
                    f"{obs.stable.ready_of(s.stable_revision)}/{spec.replicas} stable replicas ready at revision "
                    f"{s.stable_revision}", now)
    return Decision(status=s, plan=plan, events=tuple(ctx.events), consume_resume=ctx.consume_resume,
                    consumed_commands=tuple(commands.consumed))


def _stable_workload(s: Status, spec: SitsDeploymentSpec, owner: Owner) -> WorkloadSpec:
    """The stable track's workload from status (set from the spec on the very first reconcile)."""
    workload = None
    if s.stable_spec is not None:
        try:
            workload = parse_workload(s.stable_spec, "status.stableSpec")
        except SpecError:
            workload = None  # damaged by hand: the spec is the best guess of what should run
    if workload is None:
        workload = spec.workload
        s.stable_spec = workload.to_dict()
    # Recomputed every time: an operator upgrade that changes the template re-hashes in place
    s.stable_revision = revision_of(owner, workload)
    return workload


def _stable_only(ctx: _Context) -> Plan:
    revision = ctx.status.stable_revision or ctx.desired_revision
    return Plan(stable=TrackPlan(ctx.stable_workload, revision, ctx.spec.replicas),
                canary=TrackPlan(ctx.stable_workload, revision, 0))


def _clear_canary(s: Status) -> None:
    s.canary_revision = s.canary_started_at = s.current_step = s.step_started_at = None
    s.pause_reason = None
    s.abort_request = None
    s.canary_weight = 0
    s.analysis.next_run_at = None
    s.remove_condition("Paused")


def _stable_phase(ctx: _Context) -> str:
    s, obs = ctx.status, ctx.obs
    if obs.stable.serves(s.stable_revision, ctx.spec.replicas):
        return "Healthy"
    if obs.stable.deadline_exceeded:
        return "Degraded"
    return "Pending" if s.phase in (None, "Pending") else "Progressing"


def _steady(ctx: _Context) -> Plan:
    s = ctx.status
    if s.canary_revision is not None:
        ctx.event("Normal", "CanaryCancelled",
                  f"the spec is back at stable revision {s.stable_revision}; canary {s.canary_revision} scaled to 0")
    _clear_canary(s)
    s.aborted_revision = None
    s.remove_condition("RolledBack")
    s.phase = _stable_phase(ctx)
    s.set_condition("Progressing", False, "NoCanary", f"serving revision {s.stable_revision}", ctx.now)
    return _stable_only(ctx)


def _rolled_back(ctx: _Context) -> Plan:
    """The template is the aborted revision: stable only, until the template changes or a retry."""
    s = ctx.status
    _clear_canary(s)
    by_hand = aborted_by_hand(s)
    s.phase = "Degraded" if by_hand else "RolledBack"
    s.set_condition("Progressing", False, ABORTED if by_hand else "RolledBack",
                    f"revision {s.aborted_revision} was {'aborted' if by_hand else 'rolled back'}; "
                    f"{retry_hint(ctx.owner.name)}", ctx.now)
    return _stable_only(ctx)


def _start_canary(ctx: _Context) -> None:
    s = ctx.status
    ctx.event("Normal", "CanaryStarted",
              f"revision {ctx.desired_revision} started as a canary of {s.stable_revision} "
              f"({len(ctx.spec.rollout.canary.steps)} steps)")
    _clear_canary(s)
    s.canary_revision = ctx.desired_revision
    s.canary_started_at = s.step_started_at = ctx.now
    s.current_step = 0
    s.aborted_revision = None
    s.analysis = AnalysisState()
    s.phase = "Progressing"
    s.remove_condition("RolledBack")
    s.remove_condition("Analysis")


def _abort(ctx: _Context, reason: str, message: str) -> Plan:
    """Weight 0, canary at 0 replicas: RolledBack (analysis, alert), or Degraded when aborted by hand."""
    s = ctx.status
    by_hand = reason == ABORTED
    text = f"canary {s.canary_revision} {'aborted' if by_hand else 'rolled back'}: {message}"
    ctx.event("Warning", ABORTED if by_hand else "RolledBack", text)
    s.aborted_revision = s.canary_revision
    s.set_condition("RolledBack", True, reason, text, ctx.now)
    return _rolled_back(ctx)


def _progress(ctx: _Context) -> Plan:
    s, spec, obs, now = ctx.status, ctx.spec, ctx.obs, ctx.now
    steps, analysis = spec.rollout.canary.steps, spec.rollout.canary.analysis
    i = min(max(s.current_step or 0, 0), len(steps))
    request = s.abort_request
    if request is not None:
        if request.get("revision") == s.canary_revision:
            return _abort(ctx, str(request.get("reason") or "AlertFiring"), str(request.get("message") or "alert"))
        s.abort_request = None  # meant for an earlier canary
    paused = ctx.stored.pause_reason if ctx.stored.canary_revision == s.canary_revision else None
    if paused and (obs.resume_requested or ctx.stored.phase == "Progressing"):
        # Resumed by the annotation, or by a status patch setting phase back to Progressing
        ctx.consume_resume = obs.resume_requested
        if paused == PAUSE_STEP and i < len(steps) and steps[i].pause:
            i, s.step_started_at = i + 1, now
        s.analysis.consecutive_inconclusive = 0
        ctx.event("Normal", "Resumed", f"resumed from {paused}")
        s.pause_reason = None
    if obs.analysis is not None and analysis is not None and i < len(steps):
        failure = record_analysis(s, analysis, obs.analysis, now, ctx.owner.name, ctx.event)
        if failure is not None:
            return _abort(ctx, "AnalysisFailed", failure)
    i, waiting = _advance(ctx, i)
    s.current_step = i
    if i >= len(steps):
        return _promote(ctx)
    s.phase = "Paused" if s.pause_reason else "Progressing"
    if s.pause_reason == PAUSE_STEP:
        s.set_condition("Paused", True, PAUSE_STEP, f"step {i + 1}/{len(steps)}: {waiting}; "
                        f"{pause_hint(ctx.owner.name)}", now)
    elif s.pause_reason is None:
        s.remove_condition("Paused")
    s.set_condition("Progressing", True, "CanaryStep",
                    f"canary {s.canary_revision}, step {i + 1}/{len(steps)} ({steps[i].describe()}): "
                    f"{waiting or 'held by ' + str(s.pause_reason)}", now)
    target = canary_replicas(spec, s.canary_weight)
    return Plan(stable=TrackPlan(ctx.stable_workload, s.stable_revision or "", stable_replicas(spec, s.canary_weight, target, obs.canary.ready_of(s.canary_revision))),
                canary=TrackPlan(spec.workload, ctx.desired_revision, target),
                canary_weight=s.canary_weight, canary_active=True)


def _advance(ctx: _Context, i: int) -> tuple[int, str]:
    """Walk the steps from step `i` while each is done (weight served and analysed, pause over).

    Returns the first step not done (len(steps) when all are) and what it waits for ("" if nothing)."""
    s, spec, obs, now = ctx.status, ctx.spec, ctx.obs, ctx.now
    steps, analysis = spec.rollout.canary.steps, spec.rollout.canary.analysis
    while i < len(steps) and s.pause_reason != PAUSE_INCONCLUSIVE:
        step = steps[i]
        if step.set_weight is not None:
            s.canary_weight = step.set_weight
            target = canary_replicas(spec, step.set_weight)
            if not obs.canary.serves(s.canary_revision, target):
                return i, f"waiting for canary pods ({obs.canary.ready_of(s.canary_revision)}/{target} ready)"
            if analysis is not None and s.analysis.next_run_at is None and target > 0:
                s.analysis.next_run_at = now + analysis.interval_s  # the canary serves: start measuring
        else:
            elapsed = now - (s.step_started_at or now)
            if step.pause_seconds is None or elapsed < step.pause_seconds:
                s.pause_reason = PAUSE_STEP
                left = "until resumed" if step.pause_seconds is None else f"{step.pause_seconds - elapsed:.0f}s left"
                return i, f"paused, {left}"
            s.pause_reason = None
        if analysis is not None and not passed_since(s, s.step_started_at):
            return i, "waiting for a passing analysis run"
        i, s.step_started_at = i + 1, now
    return i, ""


def _promote(ctx: _Context) -> Plan:
    """Past the last step: the stable Deployment takes the canary's template; done once it is ready."""
    s, spec = ctx.status, ctx.spec
    s.pause_reason = None
    s.remove_condition("Paused")
    if ctx.obs.stable.serves(ctx.desired_revision, spec.replicas):
        ctx.event("Normal", "Promoted", f"revision {ctx.desired_revision} promoted to stable (was {s.stable_revision})")
        s.stable_spec = spec.workload.to_dict()
        s.stable_revision = ctx.desired_revision
        ctx.stable_workload = spec.workload
        _clear_canary(s)
        s.phase = "Healthy"
        s.set_condition("Progressing", False, "RolloutCompleted",
                        f"revision {ctx.desired_revision} is stable", ctx.now)
        return _stable_only(ctx)
    s.phase = "Progressing"
    ready = ctx.obs.stable.ready_of(ctx.desired_revision)
    s.set_condition("Progressing", True, "Promoting",
                    f"stable Deployment taking revision {ctx.desired_revision} ({ready}/{spec.replicas} ready)",
                    ctx.now)
    return Plan(stable=TrackPlan(spec.workload, ctx.desired_revision, spec.replicas),
                canary=TrackPlan(spec.workload, ctx.desired_revision, canary_replicas(spec, s.canary_weight)),
                canary_weight=s.canary_weight, canary_active=True)
