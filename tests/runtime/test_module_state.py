"""Modules that keep no mutable state of their own: the attention back-end registry and the GGUF cache."""

from __future__ import annotations

import hashlib
import types

import pytest

from sits.runtime.attention import registry
from sits.runtime.models import gguf_cache
from sits.runtime.models.gguf_cache import file_digest


@pytest.mark.parametrize("module", [registry, gguf_cache], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_no_module_level_container_holds_state(module: types.ModuleType):
    containers = {name: type(value).__name__ for name, value in vars(module).items()
                  if isinstance(value, dict | list | set | bytearray) and not name.startswith("__")}
    assert containers == {}


def test_a_file_digest_is_remembered_on_disk_while_the_file_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    assert file_digest(model) == hashlib.sha256(b"weights").hexdigest()
    (memo,) = (tmp_path / "cache" / "gguf-digests").iterdir()
    memo.write_text("ab" * 32)  # what a later call reads instead of hashing the file again
    assert file_digest(model) == "ab" * 32
    model.write_bytes(b"new weights")  # another size: another key
    assert file_digest(model) == hashlib.sha256(b"new weights").hexdigest()
