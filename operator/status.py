"""The SitsDeployment status: all rollout state, so a restarted operator resumes where it stopped.

`Status.from_dict` reads what is stored (tolerating fields a user or an older operator wrote
wrongly), `to_dict` writes camelCase with RFC 3339 times, and `status_patch` gives the merge patch
from the stored status to the new one: only what changed, so a quiet reconcile writes nothing.
"""

from __future__ import annotations

import copy
import datetime as dt
from dataclasses import dataclass, field, fields
from typing import Any

PHASES = ("Pending", "Progressing", "Paused", "Healthy", "Degraded", "RolledBack")


def to_timestamp(seconds: float) -> str:
    """RFC 3339 UTC with microseconds (pauses and intervals in tests are a second or two)."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def from_timestamp(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _read(kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == "time":
        return from_timestamp(value)
    if kind == "int":
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if kind == "float":
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    if kind == "str":
        return value if isinstance(value, str) else None
    if kind == "dict":
        return copy.deepcopy(value) if isinstance(value, dict) else None
    if kind == "list":
        return copy.deepcopy(value) if isinstance(value, list) else []
    raise ValueError(kind)


def _write(kind: str, value: Any) -> Any:
    return to_timestamp(value) if kind == "time" and value is not None else copy.deepcopy(value)


class _Document:
    """camelCase dict <-> dataclass, each field's kind in its metadata."""

    @classmethod
    def from_dict(cls, data: Any):
        data = data if isinstance(data, dict) else {}
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            kind = f.metadata["kind"]
            if kind == "nested":
                values[f.name] = f.metadata["type"].from_dict(data.get(_camel(f.name)))
            else:
                value = _read(kind, data.get(_camel(f.name)))
                if value is not None:
                    values[f.name] = value
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata["kind"] == "nested":
                value = value.to_dict()
            else:
                value = _write(f.metadata["kind"], value)
            if value is not None:
                result[_camel(f.name)] = value
        return result


def _f(kind: str, default: Any = None, **extra: Any) -> Any:
    if kind == "list":
        return field(default_factory=list, metadata={"kind": kind})
    if kind == "nested":
        return field(default_factory=extra["type"], metadata={"kind": kind, "type": extra["type"]})
    return field(default=default, metadata={"kind": kind})


@dataclass
class AnalysisState(_Document):
    """The P95-delta analysis of the running canary."""

    last_delta_ms: float | None = _f("float")
    last_result: str | None = _f("str")  # Passed | Failed | Inconclusive
    last_run_at: float | None = _f("time")
    next_run_at: float | None = _f("time")
    message: str | None = _f("str")
    consecutive_failures: int = _f("int", 0)
    consecutive_inconclusive: int = _f("int", 0)


@dataclass
class Status(_Document):
    phase: str | None = _f("str")
    observed_generation: int | None = _f("int")
    stable_revision: str | None = _f("str")
    stable_spec: dict[str, Any] | None = _f("dict")
    canary_revision: str | None = _f("str")
    canary_started_at: float | None = _f("time")
    canary_weight: int = _f("int", 0)
    current_step: int | None = _f("int")
    step_started_at: float | None = _f("time")
    pause_reason: str | None = _f("str")
    aborted_revision: str | None = _f("str")
    abort_request: dict[str, Any] | None = _f("dict")
    analysis: AnalysisState = _f("nested", type=AnalysisState)
    replicas: int | None = _f("int")
    ready_replicas: int | None = _f("int")
    ready: str | None = _f("str")
    selector: str | None = _f("str")
    conditions: list[dict[str, Any]] = _f("list")

    def copy(self) -> Status:
        return copy.deepcopy(self)

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == kind), None)

    def set_condition(self, kind: str, state: bool | None, reason: str, message: str, now: float) -> None:
        """Set one condition; its lastTransitionTime moves only when its status does."""
        value = "Unknown" if state is None else ("True" if state else "False")
        current = self.condition(kind)
        if current is None:
            self.conditions.append({"type": kind, "status": value, "reason": reason, "message": message,
                                    "lastTransitionTime": to_timestamp(now)})
            return
        if current.get("status") != value:
            current["lastTransitionTime"] = to_timestamp(now)
        current.update(status=value, reason=reason, message=message)

    def remove_condition(self, kind: str) -> None:
        self.conditions = [c for c in self.conditions if c.get("type") != kind]


KNOWN_KEYS = frozenset(_camel(f.name) for f in fields(Status))


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) taking `old` to `new`; {} when they are equal."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif isinstance(value, dict) and isinstance(old[key], dict):
            sub = merge_patch(old[key], value)
            if sub:
                patch[key] = sub
        elif old[key] != value:
            patch[key] = value
    return patch


def status_patch(stored: dict[str, Any] | None, new: Status) -> dict[str, Any]:
    """What to merge into `status` so its operator-owned keys equal `new` (others are left alone)."""
    stored = stored or {}
    owned = {key: value for key, value in stored.items() if key in KNOWN_KEYS}
    return merge_patch(owned, new.to_dict())
