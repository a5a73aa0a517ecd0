"""Manual rollout commands, the ones `kubectl argo rollouts` users know, as annotations on a SitsDeployment.

- `sits.ai/abort` (`abort`): the running canary stops now: all traffic back to stable, the canary
  at 0 replicas, phase Degraded (condition RolledBack, reason RolloutAborted). It stays aborted
  until the template changes again or `sits.ai/retry` is set.
- `sits.ai/promote: full` (`promote --full`): the canary skips its remaining steps and analysis and
  is promoted to stable now.
- `sits.ai/retry` (`retry`): an aborted or rolled back canary of the current template starts
  again from step 1.

(`sits.ai/resume`, Argo's plain `promote`, is part of the pauses in rollout.py.) `CommandInbox`
answers the state machine's questions in a fixed order, retry, then abort, then promote, each
against the state as it stands then: retry with promote starts the canary again and promotes it;
abort beats whatever was given with it. Every command given is consumed in the reconcile that
sees it: acted on, or refused with a Warning Event saying why. A command that did not apply never
waits to fire later by surprise (an abort left on a Healthy resource would kill the next canary).
"""

from __future__ import annotations

from collections.abc import Callable

from sits.operator.meta import ABORT_ANNOTATION, PROMOTE_ANNOTATION, RESUME_ANNOTATION, RETRY_ANNOTATION
from sits.operator.observations import ManualCommands
from sits.operator.status import Status

ABORTED = "RolloutAborted"  # the Warning Event's reason and the RolledBack condition's, phase Degraded
PROMOTED_FULL = "PromotedFull"
RETRIED = "RolloutRetried"
IGNORED = "CommandIgnored"

EventSink = Callable[[str, str, str], None]  # (Normal | Warning, reason, message)


def pause_hint(name: str) -> str:
    """What a paused canary's condition and Event suggest doing about it."""
    return (f"resume with: kubectl annotate sitsd {name} {RESUME_ANNOTATION}=true "
            f"(or {PROMOTE_ANNOTATION}=full to promote it now, {ABORT_ANNOTATION}=true to roll it back)")


def retry_hint(name: str) -> str:
    return (f"change the template to roll out again, or start this canary again with: "
            f"kubectl annotate sitsd {name} {RETRY_ANNOTATION}=true")


def aborted_by_hand(s: Status) -> bool:
    """The aborted revision was stopped by `sits.ai/abort` (not by the analysis or an alert)."""
    condition = s.condition("RolledBack") or {}
    return condition.get("reason") == ABORTED


class CommandInbox:
    """The manual commands of one reconcile; `consumed` lists the annotations to remove afterwards."""

    def __init__(self, commands: ManualCommands, event: EventSink) -> None:
        self._given = commands.present()
        self._pending = dict(self._given)
        self._event = event
        self.consumed: list[str] = []

    def _take(self, name: str) -> None:
        del self._pending[name]
        self.consumed.append(name)

    def retry(self, s: Status, desired: str) -> bool:
        """Whether to start the canary of `desired` again: it is the aborted revision, and retry was given
        (without abort). The caller starts it at step 0."""
        if RETRY_ANNOTATION not in self._pending or ABORT_ANNOTATION in self._given:
            return False
        if s.aborted_revision is None or s.aborted_revision != desired:
            return False
        self._take(RETRY_ANNOTATION)
        how = "aborted" if aborted_by_hand(s) else "rolled back"
        self._event("Normal", RETRIED, f"revision {desired} was {how}; {RETRY_ANNOTATION} starts its canary "
                                       f"again from step 1")
        return True

    def abort(self, s: Status) -> bool:
        """Whether to abort the running canary now (the caller rolls it back)."""
        if ABORT_ANNOTATION not in self._pending or s.canary_revision is None:
            return False
        self._take(ABORT_ANNOTATION)
        return True

    def promote_full(self, s: Status, steps: int) -> bool:
        """Promote the running canary now: `s.current_step` jumps past the last of `steps` steps."""
        value = self._pending.get(PROMOTE_ANNOTATION)
        if value is None or value.strip().lower() != "full" or s.canary_revision is None:
            return False
        self._take(PROMOTE_ANNOTATION)
        step = min(max(s.current_step or 0, 0), steps)
        skipped = f"skipping steps {step + 1}-{steps} and their analysis" if step < steps else "its steps were done"
        self._event("Normal", PROMOTED_FULL, f"canary {s.canary_revision} promoted to stable by "
                                             f"{PROMOTE_ANNOTATION}=full ({skipped})")
        s.current_step = steps
        s.pause_reason = None
        s.remove_condition("Paused")
        return True

    def refuse_the_rest(self, s: Status, desired: str) -> None:
        """Consume every command not acted on, with a Warning Event saying why it did not apply."""
        for name, value in list(self._pending.items()):
            self._take(name)
            self._event("Warning", IGNORED, f"{name}={value} ignored and removed: {self._why(name, value, s, desired)}")

    def _why(self, name: str, value: str, s: Status, desired: str) -> str:
        if name != ABORT_ANNOTATION and ABORT_ANNOTATION in self._given:
            return f"{ABORT_ANNOTATION}, given with it, comes first"
        if name == PROMOTE_ANNOTATION and value.strip().lower() != "full":
            return f"the value must be 'full' ({RESUME_ANNOTATION} continues past a pause)"
        if s.aborted_revision is not None and s.aborted_revision == desired:
            how = "aborted" if aborted_by_hand(s) else "rolled back"
            if name == ABORT_ANNOTATION:
                return f"revision {desired} is already {how}"
            return f"revision {desired} was {how}; {RETRY_ANNOTATION} starts its canary again"
        if name == RETRY_ANNOTATION:
            running = f"canary {s.canary_revision} is running" if s.canary_revision else "no canary was aborted"
            return f"{running}; retry applies after an abort or a rollback of the current template"
        return f"no canary is running (phase {s.phase}, stable revision {s.stable_revision})"
