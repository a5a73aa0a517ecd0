"""The API server's side of the engine boundary imports without torch.

The engine process loads the model stack (torch, the models, the kernels); the API server starts it
through `core_entry` and unpickles what it sends (the tokenizer, stats, outputs) without importing
the engine. Only structured outputs bring torch in (xgrammar's FFI layer imports it).
"""

from __future__ import annotations

import subprocess
import sys

API_SIDE = [
    "sits.runtime.commands.serve",
    "sits.runtime.server.app",
    "sits.runtime.engine.core_client",
    "sits.runtime.engine.core_entry",
    "sits.runtime.engine.bad_words",
    "sits.runtime.models.token_id_tokenizer",
]


def test_the_api_servers_modules_import_without_torch_or_the_engine():
    code = (
        "import sys, pickle\n"
        f"for name in {API_SIDE!r}: __import__(name)\n"
        "from sits.runtime.models.token_id_tokenizer import TokenIdTokenizer\n"
        "pickle.loads(pickle.dumps(TokenIdTokenizer(32, [0])))\n"
        "heavy = [m for m in ('torch', 'numpy', 'sits.runtime.engine.engine', 'sits.runtime.engine.core_process') "
        "if m in sys.modules]\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"the API side imported {result.stdout.strip()}"
