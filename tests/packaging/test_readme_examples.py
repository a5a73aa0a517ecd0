"""The README's examples, run as written against a server like `make serve`'s.

A tiny random Llama served under SmolLM2's name stands in for the embedded model (the examples' shapes
matter here, not the text); only the port differs from the README's.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.config import ModelConfig
from sits.runtime.models.loading import load_model
from sits.runtime.server.runner import BackgroundServer
from tests.support.services import free_port, started
from tests.support.serving import serve_loaded

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MODEL = "SmolLM2-135M-Instruct"
README_URL = "http://127.0.0.1:8000"


def readme_block(language: str, containing: str) -> str:
    """The README's fenced `language` block that contains `containing`."""
    blocks = [b for lang, b in re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S) if lang == language]
    matches = [b for b in blocks if containing in b]
    assert len(matches) == 1, f"the README has {len(matches)} {language} blocks with {containing!r}"
    return matches[0]


def wait_until_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{url} did not become ready"
        time.sleep(0.1)


def run_shell(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def open_server(tiny_llama_dir: Path) -> Iterator[BackgroundServer]:
    """`make serve`'s server: open, the model served as SmolLM2-135M-Instruct."""
    loaded = load_model(ModelConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                    served_model_name=MODEL), TorchAttentionBackend(), progress=False)
    with serve_loaded(loaded, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256) as (server, _):
        yield server


def test_the_curl_example(open_server: BackgroundServer) -> None:
    script = readme_block("bash", "What is the capital of France?")
    result = run_shell(script.replace(README_URL, open_server.url))
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    assert answer["usage"]["completion_tokens"] >= 1


def test_the_openai_example(open_server: BackgroundServer) -> None:
    snippet = readme_block("python", "from openai import OpenAI").replace(README_URL, open_server.url)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet, "README.md", "exec"), {})  # the README's own code, as a reader runs it
    assert printed.getvalue().strip()


def test_the_tenants_example(tiny_llama_dir: Path) -> None:
    block = readme_block("bash", "--tenants examples/tenants.yaml")
    serve_line, _, call = block.partition("\n")
    argv = shlex.split(serve_line, comments=True)
    assert argv[:2] == ["sits", "serve"]
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime", *argv[1:], "--model", str(tiny_llama_dir), "--served-model-name",
            MODEL, "--device", "cpu", "--port", str(port), "--max-model-len", "128", "--kv-cache-gb", "0.02"]
    argv = [str(ROOT / a) if a == "examples/tenants.yaml" else a for a in argv]
    with started(argv, port, timeout_s=120, log_name="serve.log") as server:
        url = f"http://127.0.0.1:{server.port}"
        wait_until_ready(url)
        result = run_shell(call.replace(README_URL, url))
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["object"] == "chat.completion", result.stdout

        keyless = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                             json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16})
        assert keyless.status_code == 401 and set(keyless.json()["error"]) == {"message", "type", "param", "code"}
