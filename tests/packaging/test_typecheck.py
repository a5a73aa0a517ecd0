"""`make lint`'s mypy run reads the source folders as the sits.* packages, with no links and no install."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_typecheck():
    spec = importlib.util.spec_from_file_location("typecheck", ROOT / ".ci" / "typecheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_checked_module_is_a_source_file_under_its_package_name():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    named = {source.module: Path(source.path) for source in
             load_typecheck().sources(ROOT, pyproject["tool"]["setuptools"]["package-dir"])}
    assert named["sits.runtime.server.app"] == ROOT / "runtime" / "server" / "app.py"
    assert named["sits.operator"] == ROOT / "operator" / "__init__.py"
    assert set(pyproject["tool"]["mypy"]["modules"]) <= set(named)
    assert "mypy_path" not in pyproject["tool"]["mypy"]


def test_lint_makes_no_links():
    lint = (ROOT / "Makefile").read_text(encoding="utf-8").split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "ln -s" not in lint and ".ci/typecheck.py" in lint
