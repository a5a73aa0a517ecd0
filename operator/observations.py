"""What a reconcile saw before it decided: the two Deployments, the manual commands, an analysis run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sits.operator.meta import (
    ABORT_ANNOTATION,
    PROMOTE_ANNOTATION,
    RETRY_ANNOTATION,
    REVISION_ANNOTATION,
)

PASSED, FAILED, INCONCLUSIVE = "Passed", "Failed", "Inconclusive"


@dataclass(frozen=True)
class AnalysisOutcome:
    """One analysis run, judged: Passed / Failed against maxDeltaMs, or Inconclusive (no data, errors).

    Attributes:
        delta_ms: canary quantile minus stable quantile in milliseconds (None when not measured).
        message: one line for the status and Events (the query's error, or the comparison).
    """

    result: str
    delta_ms: float | None
    message: str


@dataclass(frozen=True)
class DeploymentObservation:
    """A track's Deployment as the API server reports it (all zero when it does not exist)."""

    exists: bool = False
    revision: str | None = None
    replicas: int = 0  # spec.replicas
    status_replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    generation: int | None = None
    observed_generation: int | None = None
    deadline_exceeded: bool = False

    @classmethod
    def from_object(cls, obj: dict[str, Any] | None) -> DeploymentObservation:
        if not obj:
            return cls()
        meta, spec, status = obj.get("metadata", {}), obj.get("spec", {}), obj.get("status") or {}
        conditions = status.get("conditions") or []
        deadline = any(c.get("type") == "Progressing" and c.get("status") == "False"
                       and c.get("reason") == "ProgressDeadlineExceeded" for c in conditions)
        return cls(
            exists=True,
            revision=(meta.get("annotations") or {}).get(REVISION_ANNOTATION),
            replicas=_int(spec.get("replicas"), 1),
            status_replicas=_int(status.get("replicas"), 0),
            ready_replicas=_int(status.get("readyReplicas"), 0),
            updated_replicas=_int(status.get("updatedReplicas"), 0),
            generation=_int(meta.get("generation"), None),
            observed_generation=_int(status.get("observedGeneration"), None),
            deadline_exceeded=deadline,
        )

    def serves(self, revision: str | None, replicas: int) -> bool:
        """Runs `replicas` ready pods of `revision`, with nothing of the spec left to roll out."""
        if not self.exists or revision is None or self.revision != revision or self.replicas != replicas:
            return False
        if (self.generation is not None and self.observed_generation is not None
                and self.observed_generation < self.generation):
            return False
        return self.ready_replicas >= replicas and self.updated_replicas >= replicas

    def ready_of(self, revision: str | None) -> int:
        """Ready pods that belong to `revision` (0 while the Deployment runs another one)."""
        return self.ready_replicas if self.exists and self.revision == revision else 0


@dataclass(frozen=True)
class ManualCommands:
    """The manual rollout commands annotated on the resource: each attribute is the annotation's value,
    None when it is absent (`sits.ai/resume` is `Observations.resume_requested`)."""

    abort: str | None = None  # sits.ai/abort: any value
    promote: str | None = None  # sits.ai/promote: "full"
    retry: str | None = None  # sits.ai/retry: any value

    @classmethod
    def from_annotations(cls, annotations: dict[str, Any] | None) -> ManualCommands:
        found = annotations or {}
        return cls(**{attribute: str(found[name]) for attribute, name in _COMMANDS.items() if name in found})

    def present(self) -> dict[str, str]:
        """annotation name -> value of each command given, in the order they are considered."""
        values = {attribute: getattr(self, attribute) for attribute in _COMMANDS}
        return {name: values[attribute] for attribute, name in _COMMANDS.items() if values[attribute] is not None}


_COMMANDS = {"retry": RETRY_ANNOTATION, "abort": ABORT_ANNOTATION, "promote": PROMOTE_ANNOTATION}


@dataclass(frozen=True)
class Observations:
    """Inputs of `rollout.decide` besides the spec, the stored status and the clock.

    Attributes:
        generation: the SitsDeployment's metadata.generation (for status.observedGeneration).
        resume_requested: the `sits.ai/resume` annotation is present.
        commands: the other manual commands (abort, promote full, retry) annotated on the resource.
        analysis: the analysis run made this reconcile (None when none was due).
    """

    stable: DeploymentObservation = DeploymentObservation()
    canary: DeploymentObservation = DeploymentObservation()
    generation: int | None = None
    resume_requested: bool = False
    commands: ManualCommands = ManualCommands()
    analysis: AnalysisOutcome | None = None


def _int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
