"""`sits`: the command line. Each subcommand lives in its own module under sits.runtime.commands.

A subcommand module exposes `register(subparsers) -> argparse.ArgumentParser`; the parser it returns
has `handler` set (via `set_defaults(handler=...)`) to a function `(args) -> int` (the exit code).
Adding a subcommand is one line in COMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> module; modules are imported when the parser is built (keep their top level light).
COMMANDS: dict[str, str] = {
    "serve": "sits.runtime.commands.serve",
    "generate": "sits.runtime.commands.generate",
    "bench": "sits.runtime.commands.bench",
    "operator": "sits.operator.__main__",
    "router": "sits.runtime.router.command",
}


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `sits` parser; `only`: register just that subcommand (its module alone is imported, so
    `sits serve` starts without importing every other command's dependencies)."""
    parser = OneLineErrorParser(prog="sits", description="SITS: serve LLMs to many tenants, fast.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    for name, module_name in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
