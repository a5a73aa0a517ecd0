"""--lora-root: a runtime-loaded adapter's local path must resolve inside an allowed root, and
whatever is refused (outside, `..`, a symlink out, missing, unreadable, not an adapter) gets one
answer that tells nothing about the server's files. hf:// ids are not paths and pass.

The endpoint itself runs in test_lora_runtime_updates.py's server (roots on its adapters' folder);
here the rule, then the answers of a server over a root."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sits.runtime.lora.config import LoraConfig
from sits.runtime.lora.roots import GENERIC_REFUSAL, AdapterPathRefused, checked_adapter_path
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.server.security import ServerSecurity
from tests.runtime.lora_helpers import write_peft_adapter
from tests.support.serving import serve_loaded


def test_paths_resolve_inside_a_root_or_are_refused(tmp_path):
    root = (tmp_path / "adapters").resolve()
    (root / "sql").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (root / "escape").symlink_to(tmp_path / "secret")
    assert checked_adapter_path(str(root / "sql"), [root]) == str(root / "sql")
    assert checked_adapter_path(str(root / "x" / ".." / "sql"), [root]) == str(root / "sql")
    assert checked_adapter_path("hf://org/adapter@main", []) == "hf://org/adapter@main"
    for path in (str(root / ".." / "secret"), "../../../../etc", str(root / "escape"), "/etc/passwd",
                 str(tmp_path / "adapters-other"), "a\x00b"):
        with pytest.raises(AdapterPathRefused) as refused:
            checked_adapter_path(path, [root])
        assert str(refused.value) == GENERIC_REFUSAL
    with pytest.raises(AdapterPathRefused):  # no root given: no local path at all
        checked_adapter_path(str(root / "sql"), [])


@pytest.fixture(scope="module")
def root_server(tiny, tmp_path_factory) -> Iterator[tuple[BackgroundServer, Path]]:
    base = tmp_path_factory.mktemp("lora-roots")
    root = base / "adapters"
    write_peft_adapter(root / "good", tiny.config, rank=4, alpha=8, seed=5)
    broken = write_peft_adapter(root / "broken", tiny.config, rank=4, alpha=8, seed=6)
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not safetensors at all")
    write_peft_adapter(base / "outside", tiny.config, rank=4, alpha=8, seed=7)
    lora = LoraConfig(enable_lora=True, max_loras=2, max_lora_rank=8, allow_runtime_updating=True)
    with serve_loaded(tiny, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=128, lora=lora,
                      security=ServerSecurity(lora_roots=(root.resolve(),))) as (server, engine):
        try:
            yield server, root
        finally:
            engine.engine.lora.detach()


def _load(server: BackgroundServer, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def test_the_endpoint_gives_one_answer_for_everything_outside_or_unreadable(root_server):
    server, root = root_server
    refused = [_load(server, "x", path) for path in (
        str(root.parent / "outside"),  # a real adapter, outside the root
        str(root / ".." / "outside"),  # the same through ..
        "../../../../etc",
        "/etc/passwd",  # exists
        str(root / "missing"),  # inside the root, absent
        str(root / "broken"),  # inside the root, safetensors cannot parse it
    )]
    bodies = {answer.text for answer in refused}
    assert all(answer.status_code == 400 for answer in refused)
    assert len(bodies) == 1, bodies  # nothing tells one case from another
    error = refused[0].json()["error"]
    assert error["param"] == "lora_path" and error["message"] == GENERIC_REFUSAL
    assert "safetensors" not in error["message"] and str(root) not in error["message"]
    assert _load(server, "good", str(root / "good")).status_code == 200
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200
