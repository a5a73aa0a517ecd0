"""Rendering the Helm chart offline (helm-python-sdk) into Kubernetes objects, for the packaging tests."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "charts" / "sits-operator"
FULL_VALUES = CHART_DIR / "ci" / "full-values.yaml"
KIND_VALUES = ROOT / "examples" / "values-kind.yaml"
RELEASE = "sits"
NAMESPACE = "sits-system"
KUBE_VERSION = "1.30.0"


@cache
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART_DIR)


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included)."""
    return chart().render(values or {}, name=RELEASE, namespace=NAMESPACE)


def objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every rendered Kubernetes object, in template order."""
    found = []
    for path, text in sorted(render(values).items()):
        if path.endswith(".txt"):
            continue
        found += [doc for doc in yaml.safe_load_all(text) if doc]
    return found


def one(objs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind} named *{name_suffix}, found {[m['metadata']['name'] for m in matches]}"
    return matches[0]


def rbac_rules(objs: list[dict[str, Any]], kind: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) granted by the rendered ClusterRole or Role."""
    granted = set()
    for role in (o for o in objs if o["kind"] == kind):
        for rule in role.get("rules") or []:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((group, resource, verb))
    return granted
