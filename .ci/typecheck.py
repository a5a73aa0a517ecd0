"""mypy over the `sits.*` packages straight from the source folders (`make lint`), with no install and no links.

The folders `runtime`, `operator` and `kernels` are the packages `sits.runtime`, `sits.operator` and
`sits.kernels` (`[tool.setuptools] package-dir` in pyproject.toml, the one place that says so). mypy cannot
map a folder to another package name by itself, and an editable install is an import hook it does not
follow, so this hands mypy every source file under its `sits.*` name. Errors are reported for the modules
`[tool.mypy] modules` lists, and for no other (as with `follow_imports = "silent"`): the rest is read for
its types only.

mypy runs from an empty folder: the repository root holds `operator/`, which would otherwise shadow the
standard library's `operator` module. Paths in the errors are relative to the repository root.

Usage (from the repository root): `python .ci/typecheck.py`; exit status 1 when mypy reports errors.
"""

from __future__ import annotations

import os
import sys
import tempfile
import tomllib
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.fscache import FileSystemCache
from mypy.main import process_options
from mypy.modulefinder import BuildSource


def sources(root: Path, package_dirs: dict[str, str]) -> list[BuildSource]:
    """Every .py file below each package folder, named as the package it installs as (absolute paths)."""
    found = []
    for package, folder in package_dirs.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = [part for part in path.relative_to(base).with_suffix("").parts if part != "__init__"]
            found.append(BuildSource(str(path), ".".join([package, *parts]), None))
    return found


def main() -> int:
    root = Path.cwd().resolve()
    pyproject = root / "pyproject.toml"
    package_dirs = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    fscache = FileSystemCache()
    targets, options = process_options(["--config-file", str(pyproject)], fscache=fscache)
    checked = {target.module for target in targets}
    everything = sources(root, package_dirs)
    missing = checked - {source.module for source in everything}
    if missing:
        print(f"mypy: no source file for {', '.join(sorted(missing))}", file=sys.stderr)
        return 2
    for source in everything:
        if source.module not in checked:
            options.per_module_options.setdefault(source.module, {})["ignore_errors"] = True
    options.cache_dir = str(root / options.cache_dir)
    prefix = f"{root}{os.sep}"
    with tempfile.TemporaryDirectory() as empty:
        os.chdir(empty)
        try:
            messages = build.build(everything, options, fscache=fscache).errors
        except CompileError as error:
            messages = error.messages
        finally:
            os.chdir(root)
    for message in messages:
        print(message.replace(prefix, ""))
    if messages:
        return 1
    print(f"Success: no issues found in {len(checked)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
