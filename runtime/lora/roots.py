"""Where runtime-loaded LoRA adapters may come from: `--lora-root DIR` (repeatable).

`POST /v1/load_lora_adapter` reads files at a path the caller names. Unchecked, that reveals
which server paths exist (different errors for a missing directory and an unreadable file),
accepts `../../etc`, and echoes parser errors of whatever file it opened. So a local path is
resolved (symlinks and `..` followed) and must lie inside one of the roots; no root given means
no local path loads at runtime. Anything refused — outside the roots, missing, unreadable, not an
adapter — gets the one answer of `AdapterPathRefused`, which says nothing about the path.
`hf://org/name[@rev]` ids are not paths and are not affected. Adapters named at start-up
(`--lora-modules`) come from the operator, not a caller, and are not checked here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sits.runtime.lora.config import HF_SCHEME

GENERIC_REFUSAL = ("lora_path is not an adapter this server may load: give an hf:// id, or a readable PEFT adapter "
                   "directory under one of the server's --lora-root directories")


class AdapterPathRefused(ValueError):
    """A runtime adapter path outside the roots or not loadable (the message never names the path)."""

    def __init__(self) -> None:
        super().__init__(GENERIC_REFUSAL)


def is_hub_id(path: str) -> bool:
    return path.startswith(HF_SCHEME)


def checked_adapter_path(path: str, roots: Sequence[Path]) -> str:
    """`path` resolved, when it is an hf:// id or lies inside one of `roots` (resolved directories).

    Raises:
        AdapterPathRefused: a local path with no roots, outside every root, or that cannot be resolved.
    """
    if is_hub_id(path):
        return path
    if not roots or "\x00" in path:
        raise AdapterPathRefused
    try:
        resolved = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a path too long
        raise AdapterPathRefused from None
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise AdapterPathRefused
    return str(resolved)
