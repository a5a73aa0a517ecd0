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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="sits", description="SITS: serve LLMs to many tenants, fast.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    for module_name in COMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
