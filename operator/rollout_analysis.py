"""The canary analysis as the rollout state machine sees it: when a run is due, and what each run means.

`analysis_due` tells the reconciler whether to query the metric provider before deciding;
`record_analysis` folds the run's outcome into `status.analysis` (consecutive failures and
inconclusive runs) and says when the canary must roll back; `passed_since` tells a step whether it
may go on. Pure functions over the status, like the rest of the state machine.
"""

from __future__ import annotations

from collections.abc import Callable

from sits.operator.meta import Owner
from sits.operator.observations import FAILED, PASSED, AnalysisOutcome
from sits.operator.revisions import revision_of
from sits.operator.rollout_commands import pause_hint
from sits.operator.spec import SitsDeploymentSpec
from sits.operator.spec_rollout import AnalysisSpec
from sits.operator.status import Status

PAUSE_INCONCLUSIVE = "AnalysisInconclusive"

EventSink = Callable[[str, str, str], None]  # (Normal | Warning, reason, message)


def analysis_due(spec: SitsDeploymentSpec, owner: Owner, status: Status, now: float) -> bool:
    """Whether this reconcile should run the canary analysis before deciding."""
    if spec.rollout.canary.analysis is None or status.canary_revision is None:
        return False
    if status.current_step is None or status.current_step >= len(spec.rollout.canary.steps):
        return False  # promoting: both tracks run the same revision
    if status.canary_revision != revision_of(owner, spec.workload):
        return False  # the spec moved on; this canary is about to be replaced
    return status.analysis.next_run_at is not None and now >= status.analysis.next_run_at


def record_analysis(s: Status, limits: AnalysisSpec, outcome: AnalysisOutcome, now: float, name: str,
                    event: EventSink) -> str | None:
    """Fold one run into `s.analysis`; returns the abort message once `failureLimit` runs failed in a row.

    `inconclusiveLimit` inconclusive runs in a row pause the canary (reason AnalysisInconclusive)
    until a user resumes it: no data is never a pass, and never a rollback.
    """
    a = s.analysis
    a.last_run_at = now
    following = (a.next_run_at or now) + limits.interval_s
    a.next_run_at = following if following > now else now + limits.interval_s
    a.last_result, a.message = outcome.result, outcome.message
    if outcome.delta_ms is not None:
        a.last_delta_ms = round(outcome.delta_ms, 3)
    if outcome.result == PASSED:
        a.consecutive_failures = a.consecutive_inconclusive = 0
    elif outcome.result == FAILED:
        a.consecutive_failures += 1
        a.consecutive_inconclusive = 0
    else:
        a.consecutive_inconclusive += 1
    state = {PASSED: True, FAILED: False}.get(outcome.result)
    s.set_condition("Analysis", state, outcome.result, outcome.message, now)
    if a.consecutive_failures >= limits.failure_limit:
        return (f"{outcome.message} ({a.consecutive_failures} consecutive failed analysis runs, "
                f"failureLimit {limits.failure_limit})")
    if a.consecutive_inconclusive >= limits.inconclusive_limit and s.pause_reason != PAUSE_INCONCLUSIVE:
        s.pause_reason = PAUSE_INCONCLUSIVE
        text = (f"{a.consecutive_inconclusive} analysis runs in a row were inconclusive ({outcome.message}); "
                f"{pause_hint(name)}")
        s.set_condition("Paused", True, PAUSE_INCONCLUSIVE, text, now)
        event("Warning", PAUSE_INCONCLUSIVE, text)
    return None


def passed_since(s: Status, since: float | None) -> bool:
    """An analysis run passed after `since` (the current step's start)."""
    a = s.analysis
    return (a.last_result == PASSED and a.last_run_at is not None and since is not None
            and a.last_run_at > since)
