"""mkdocs hook: leave nav entries whose page does not exist (yet) out of the nav.

Some pages of the site are written on other branches; the nav lists them all, and until a page's file is
in `docs/` this hook drops its entry (an empty section too), so `mkdocs build --strict` passes with and
without them. Pages that exist are kept as written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.optional_pages")


def prune(nav: list[Any], docs_dir: Path, missing: list[str]) -> list[Any]:
    """The nav without entries naming a missing .md file under docs_dir (their names go to missing)."""
    kept: list[Any] = []
    for entry in nav:
        title, target = next(iter(entry.items())) if isinstance(entry, dict) else (None, entry)
        if isinstance(target, list):
            children = prune(target, docs_dir, missing)
            if children:
                kept.append({title: children} if title is not None else children)
        elif isinstance(target, str) and target.endswith(".md") and "://" not in target \
                and not (docs_dir / target).is_file():
            missing.append(target)
        else:
            kept.append(entry)
    return kept


def on_config(config: Any) -> Any:
    """Prune the nav before mkdocs validates it."""
    if config.nav:
        missing: list[str] = []
        config.nav = prune(config.nav, Path(config.docs_dir), missing)
        if missing:
            log.info("pages not in this tree, left out of the nav: %s", ", ".join(missing))
    return config
