"""`--lora-modules NAME=hf://org/name[@revision]`: an adapter from the Hub, fetched by the base model's Hub
helper into the same Hugging Face cache, exercised offline only.

As in test_models_loading_hf_uri, the cases that touch the Hub client run in a fresh interpreter with
HF_HUB_OFFLINE=1, an HF_HOME of their own and HF_ENDPOINT on a local port nothing listens on: an adapter
placed in the cache as snapshot_download leaves it serves under its name, and an empty cache is a
one-line error naming the flag.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sits.runtime.config import ConfigError, EngineConfig, ModelConfig
from sits.runtime.lora.config import LoraConfig, LoraConfigError, LoraModule
from tests.runtime.lora_helpers import write_peft_adapter
from tests.runtime.test_models_loading_hf_uri import offline_env, seed_cache

GENERATE = ["-m", "sits.runtime", "generate", "Say hi", "--device", "cpu", "--dtype", "float32",
            "--max-tokens", "6", "--temperature", "0", "--max-model-len", "128"]
RUN_END = "\n<end of run>\n"
# Runs `sits` (its `main`, as `python -m sits.runtime` does) once per argv in argv[1] (a JSON list), each
# run's stdout followed by RUN_END; exits non-zero at the first run that fails.
RUN_EACH = f"""
import json, sys
from sits.runtime.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code:
        sys.exit(code)
    sys.stdout.write({RUN_END!r})
    sys.stdout.flush()
"""


def test_an_hf_adapter_is_checked_for_form_before_the_model_loads():
    LoraConfig(enable_lora=True, modules=[LoraModule("sql", "hf://org/sql-lora@v1")]).validate()  # no download yet
    for uri in ("hf://", "hf://org/name/extra", "hf://org/name@", "hf://org/na me"):
        config = EngineConfig(model=ModelConfig(device="cpu"),
                              lora=LoraConfig(enable_lora=True, modules=[LoraModule("sql", uri)]))
        with pytest.raises(ConfigError, match=r"expected hf://org/name or hf://org/name@revision") as raised:
            config.validate()
        assert str(raised.value).startswith(f"--lora-modules sql={uri} is not a Hugging Face repository")


def test_an_hf_adapter_serves_from_the_cache_as_its_local_copy_does(tmp_path, tiny_llama_dir, tiny):
    """`sits generate --lora` answers the same with the adapter from the Hub cache and from its directory.

    The three runs (Hub cache, directory, no adapter) are the `sits` command's own `main`, one after
    another in one fresh offline interpreter: one interpreter start instead of three.
    """
    adapter = write_peft_adapter(tmp_path / "sql-lora", tiny.config, rank=4, b_std=1.0)
    hf_home = tmp_path / "hf"
    seed_cache(hf_home, "sits-test/sql-lora", adapter)
    runs = [[*GENERATE[2:], "--model", str(tiny_llama_dir), "--enable-lora", "--lora-modules", f"sql={path}",
             "--lora", "sql"] for path in ("hf://sits-test/sql-lora", str(adapter))]
    runs.append([*GENERATE[2:], "--model", str(tiny_llama_dir)])
    result = subprocess.run([sys.executable, "-c", RUN_EACH, json.dumps(runs)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=offline_env(hf_home))
    assert result.returncode == 0, result.stderr
    *answers, base, rest = result.stdout.split(RUN_END)
    assert rest == "" and len(answers) == 2, result.stdout
    assert answers[0] == answers[1] != base, result.stdout  # the adapter took effect, from either source


def test_offline_an_uncached_hf_adapter_is_a_one_line_error(tmp_path, tiny_llama_dir):
    result = subprocess.run(
        [sys.executable, *GENERATE, "--model", str(tiny_llama_dir), "--enable-lora",
         "--lora-modules", "sql=hf://sits-test/absent-lora"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env=offline_env(tmp_path / "hf"))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert "--lora-modules sql=hf://sits-test/absent-lora:" in line and "not in the Hugging Face cache" in line
    assert "HF_HUB_OFFLINE is set" in line


def test_a_malformed_hf_adapter_reaching_the_loader_names_the_flag(tiny):
    from sits.runtime.lora.adapter import load_adapter

    with pytest.raises(LoraConfigError, match=r"^--lora-modules sql=hf://a/b/c: .*expected hf://org/name"):
        load_adapter(LoraModule("sql", "hf://a/b/c"), tiny.config, 16)
