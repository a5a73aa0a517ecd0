"""Reading one level of a CR spec with the field path in every error.

`Fields` wraps a mapping found at a path such as `spec.rollout.canary` and reads typed values out
of it; a wrong type, a value out of range or a key nobody knows raises `SpecError` naming the full
path (`spec.engine.maxNumSeqs: must be an integer >= 1, got 0`), which the operator copies into
the resource's `InvalidSpec` condition.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any, TypeVar

_Spec = TypeVar("_Spec")

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?(?:ms|h|m|s))+$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_MISSING = object()


class SpecError(ValueError):
    """A field of the spec is invalid. `path` is the field (`spec.rollout.canary.steps[1].pause`)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def parse_duration(value: Any, path: str) -> float:
    """Seconds in a duration: `30s`, `5m`, `1h`, `1h30m`, `250ms`, or a bare number of seconds."""
    if isinstance(value, bool):
        raise SpecError(path, f"must be a duration such as 30s, 5m or 1h, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and _DURATION.match(value.strip()):
        seconds = sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(value.strip()))
    else:
        raise SpecError(path, f"must be a duration such as 30s, 5m or 1h, got {value!r}")
    if seconds < 0:
        raise SpecError(path, f"must not be negative, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest PromQL-compatible spelling of a whole number of seconds (`300` -> `5m`)."""
    whole = max(1, round(seconds))
    if whole % 3600 == 0:
        return f"{whole // 3600}h"
    if whole % 60 == 0:
        return f"{whole // 60}m"
    return f"{whole}s"


def spec_field(key: str, kind: str, default: Any = dataclasses.MISSING, **checks: Any) -> Any:
    """A dataclass field read from the camelCase `key` by `Fields.parse_into`.

    Args:
        key: the field's name in the CR (`maxNumSeqs`).
        kind: the `Fields` getter that reads it: "string", "integer", "number", "duration" or "boolean".
        default: the value when the key is absent (also the dataclass default); left out, the key is required.
        checks: the getter's keyword checks (`minimum=1`, `choices=...`).
    """
    return dataclasses.field(default=default, metadata={"key": key, "kind": kind, "checks": checks})


class Fields:
    """Typed access to the mapping at `path`; every getter names `path.key` in its errors."""

    def __init__(self, data: Any, path: str, known: set[str] | None = None) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise SpecError(path, f"must be an object, got {type(data).__name__}")
        self.data = data
        self.path = path
        if known is not None:
            self.reject_unknown(known)

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def reject_unknown(self, known: set[str]) -> None:
        for key in self.data:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(sorted(known))})"
                raise SpecError(self.at(str(key)), f"unknown field{hint}")

    def _get(self, key: str, default: Any, required: bool) -> Any:
        value = self.data.get(key, _MISSING)
        if value is _MISSING or value is None:
            if required:
                raise SpecError(self.at(key), "is required")
            return default
        return value

    def string(self, key: str, default: str | None = None, *, required: bool = False,
               choices: tuple[str, ...] | None = None, pattern: re.Pattern[str] | None = None,
               what: str = "") -> str | None:
        value = self._get(key, default, required)
        if value is None:
            return None
        if not isinstance(value, str) or (required and not value):
            raise SpecError(self.at(key), f"must be a non-empty string, got {value!r}")
        if choices is not None and value not in choices:
            raise SpecError(self.at(key), f"must be one of {', '.join(choices)}, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise SpecError(self.at(key), f"must be {what or 'of the form ' + pattern.pattern}, got {value!r}")
        return value

    def integer(self, key: str, default: int | None = None, *, required: bool = False,
                minimum: int | None = None, maximum: int | None = None) -> int | None:
        value = self._get(key, default, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(self.at(key), f"must be an integer, got {value!r}")
        self._check_range(key, value, minimum, maximum, "an integer")
        return value

    def number(self, key: str, default: float | None = None, *, required: bool = False,
               minimum: float | None = None, maximum: float | None = None,
               exclusive_minimum: bool = False, exclusive_maximum: bool = False) -> float | None:
        value = self._get(key, default, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(self.at(key), f"must be a number, got {value!r}")
        value = float(value)
        if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
            sign = ">" if exclusive_minimum else ">="
            raise SpecError(self.at(key), f"must be a number {sign} {minimum:g}, got {value:g}")
        if maximum is not None and (value >= maximum if exclusive_maximum else value > maximum):
            sign = "<" if exclusive_maximum else "<="
            raise SpecError(self.at(key), f"must be a number {sign} {maximum:g}, got {value:g}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default, False)
        if not isinstance(value, bool):
            raise SpecError(self.at(key), f"must be true or false, got {value!r}")
        return value

    def duration(self, key: str, default: float | None = None, *, required: bool = False,
                 minimum: float | None = None) -> float | None:
        value = self._get(key, default, required)
        if value is None:
            return None
        seconds = parse_duration(value, self.at(key))
        if minimum is not None and seconds < minimum:
            raise SpecError(self.at(key), f"must be at least {minimum:g}s, got {value!r}")
        return seconds

    def parse_into(self, cls: type[_Spec], **given: Any) -> _Spec:
        """An instance of the dataclass `cls`, each `spec_field` of it read from this mapping in field order.

        `given`: values of fields read elsewhere (a nested object's, or one with a check of its own).
        Raises SpecError for the first invalid field, as the getters do.
        """
        values = dict(given)
        for item in dataclasses.fields(cls):  # type: ignore[arg-type]
            if item.name in given or "key" not in item.metadata:
                continue
            key, getter = item.metadata["key"], getattr(self, item.metadata["kind"])
            if item.metadata["kind"] == "boolean":
                values[item.name] = getter(key, item.default)
                continue
            required = item.default is dataclasses.MISSING
            values[item.name] = getter(key, None if required else item.default, required=required,
                                       **item.metadata["checks"])
        return cls(**values)

    def child(self, key: str, known: set[str] | None = None, *, required: bool = False) -> Fields | None:
        """The nested object at key (None when absent and not required)."""
        value = self._get(key, None, required)
        if value is None:
            return None
        return Fields(value, self.at(key), known)

    def items(self, key: str, *, required: bool = False) -> list[tuple[str, Any]]:
        """(path, value) of each element of the list at key."""
        value = self._get(key, [], required)
        if not isinstance(value, list):
            raise SpecError(self.at(key), f"must be a list, got {type(value).__name__}")
        return [(f"{self.at(key)}[{index}]", item) for index, item in enumerate(value)]

    def string_map(self, key: str, key_pattern: re.Pattern[str] | None = None, what: str = "") -> dict[str, str]:
        value = self._get(key, {}, False)
        if not isinstance(value, Mapping):
            raise SpecError(self.at(key), f"must be an object of strings, got {type(value).__name__}")
        result: dict[str, str] = {}
        for name, item in value.items():
            if key_pattern is not None and not key_pattern.match(str(name)):
                raise SpecError(f"{self.at(key)}.{name}", f"must be {what}")
            if not isinstance(item, str):
                raise SpecError(f"{self.at(key)}.{name}", f"must be a string (quote it in YAML), got {item!r}")
            result[str(name)] = item
        return result

    def _check_range(self, key: str, value: float, minimum: float | None, maximum: float | None,
                     what: str) -> None:
        if minimum is not None and value < minimum:
            raise SpecError(self.at(key), f"must be {what} >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise SpecError(self.at(key), f"must be {what} <= {maximum}, got {value}")
