"""`--model hf://org/name`: the loader resolves it with huggingface_hub, exercised offline only.

Nothing here reaches the network. The cases that touch the Hub client run in a fresh interpreter
(huggingface_hub reads its environment at import) with HF_HUB_OFFLINE=1, an HF_HOME of their own
and HF_ENDPOINT on a local port nothing listens on: an empty cache is a one-line ModelLoadError,
and a repository placed in the cache, laid out as snapshot_download leaves it, loads under its name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sits.runtime.models.loading import ModelLoadError, hf_snapshot_dir
from tests.support.services import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}


def seed_cache(hf_home: Path, repo_id: str, checkpoint: Path) -> Path:
    """`checkpoint`'s files as the Hub cache holds a download of `repo_id` at `main`."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return Path(shutil.copytree(checkpoint, repo / "snapshots" / COMMIT))


def test_offline_with_an_empty_cache_sits_serve_fails_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "sits.runtime", "serve", "--model", "hf://sits-test/absent", "--device", "cpu",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=offline_env(tmp_path / "hf"))
    assert result.returncode == 2, result.stderr
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert "hf://sits-test/absent" in line and "not in the Hugging Face cache" in line
    assert str(tmp_path / "hf" / "hub") in line and "HF_HUB_OFFLINE is set" in line


LOAD_BOTH = """
import json, sys
from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ModelConfig
from sits.runtime.models.loading import load_model
hub, local = (load_model(ModelConfig(model=m, device="cpu"), TorchAttentionBackend(), progress=False)
              for m in sys.argv[1:3])
same = all((a == b).all().item() for a, b in zip(hub.model.state_dict().values(), local.model.state_dict().values()))
print(json.dumps({"name": hub.name, "source": hub.source, "layers": hub.config.num_hidden_layers, "same": same,
                  "vocab": hub.tokenizer.vocab_size == local.tokenizer.vocab_size}))
"""


def test_offline_a_cached_repository_loads_under_its_name(tmp_path, tiny_llama_dir):
    hf_home = tmp_path / "hf"
    seed_cache(hf_home, "sits-test/tiny-llama", tiny_llama_dir)
    result = subprocess.run([sys.executable, "-c", LOAD_BOTH, "hf://sits-test/tiny-llama", str(tiny_llama_dir)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=offline_env(hf_home))
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == {"name": "tiny-llama", "source": "hf://sits-test/tiny-llama", "layers": 2, "same": True,
                      "vocab": True}


@pytest.mark.parametrize("uri", ["hf://", "hf://org/name/extra", "hf://org/name@", "hf://org/na me", "hf:///name"])
def test_a_malformed_uri_is_a_model_load_error(uri):
    with pytest.raises(ModelLoadError, match="expected hf://org/name or hf://org/name@revision"):
        hf_snapshot_dir(uri)


def test_without_huggingface_hub_the_error_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` fails, as when missing
    with pytest.raises(ModelLoadError, match=r"hf://org/name needs huggingface_hub: pip install huggingface_hub"):
        hf_snapshot_dir("hf://org/name")
