"""A grammar-compile worker process: `python -m sits.runtime.server.grammar_worker`.

The server (`grammar_compiler.GrammarCompiler`) starts it, and kills it when a compile runs past
its timeout or its client leaves: a thread cannot be stopped, a process can.

Protocol: one JSON document per line. Stdin's first line is xgrammar's serialized tokenizer
info (`GrammarCache.tokenizer_info_json`); the worker answers `{"ready": true}`. Each next line is
a job `{"kind", "text", "source"}` (a `StructuredOutputSpec`), answered by `{"ok": true}` when it
compiles, or `{"error": "<message>"}` naming the field when xgrammar refuses it. Stdout carries
nothing else (stray output of libraries goes to stderr).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, BinaryIO


def _answer(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def main() -> int:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the answers
    info_line = sys.stdin.buffer.readline()
    if not info_line:
        return 0
    import xgrammar

    from sits.runtime.engine.request import StructuredOutputSpec
    from sits.runtime.engine.structured_output import (
        StructuredOutputError,
        compile_spec,
        grammar_compiler_for,
    )

    compiler = grammar_compiler_for(xgrammar.TokenizerInfo.deserialize_json(info_line.decode()))
    _answer(out, {"ready": True})
    for line in sys.stdin.buffer:
        job = json.loads(line)
        try:
            compile_spec(compiler, StructuredOutputSpec(job["kind"], job["text"], job["source"]))
        except StructuredOutputError as error:
            _answer(out, {"error": str(error)})
        else:
            _answer(out, {"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
