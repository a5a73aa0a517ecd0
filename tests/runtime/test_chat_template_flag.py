"""`--chat-template`: a jinja2 file, or the template text itself, in place of the model's own template.

SmolLM2-135M-Instruct is loaded through load_model with the override and served for real: /tokenize
and /v1/chat/completions (official `openai` client, tools with tool_choice "none") render the same
prompt, the override's tool block included; an inline template works too; a template that does not
compile, or a file that does not exist, is a one-line error naming the flag, from the CLI process.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sits.runtime.attention.torch_ref import TorchAttentionBackend
from sits.runtime.cli import main
from sits.runtime.config import ConfigError, ModelConfig, read_chat_template
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.models.loading import load_model
from sits.runtime.server.runner import BackgroundServer
from tests.support.models import load_smollm2_with_template
from tests.support.serving import serve_loaded

# A ChatML template (SmolLM2's turn markers) that lists each tool's function name in a system block.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Functions you may call:
{% for tool in tools %}- {{ tool.function.name }}: {{ tool.function.description }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "lookup_tide_tables", "description": "High and low tides",
                                           "parameters": {"type": "object", "properties": {"port": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "When is high tide in Brest?"}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def served(smollm2_checkpoint_dir, template_file) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    with serve_loaded(load_smollm2_with_template(str(template_file)), max_model_len=512, num_blocks=32, max_num_seqs=2,
                      max_num_batched_tokens=256) as served:
        yield served


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0].url, timeout=120) as client:
        yield client


def test_the_file_template_renders_tools_alike_in_tokenize_and_chat_completions(http, client, model):
    with_tools = http.post("/tokenize", json={"model": model, "messages": ASK, "tools": TOOLS})
    without_tools = http.post("/tokenize", json={"model": model, "messages": ASK})
    assert with_tools.status_code == 200 and without_tools.status_code == 200, with_tools.text
    count = with_tools.json()["count"]
    assert count > without_tools.json()["count"]

    answer = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                            max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens == count
    assert answer.choices[0].message.tool_calls is None

    text = http.post("/detokenize", json={"model": model, "tokens": with_tools.json()["tokens"]}).json()["prompt"]
    assert "Functions you may call:\n- lookup_tide_tables: High and low tides" in text
    assert text.endswith("When is high tide in Brest?<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant" not in text  # SmolLM2's own default system prompt is gone


def test_an_inline_template_replaces_the_model_template_and_is_logged(smollm2, caplog):
    inline = "{% for message in messages %}[{{ message.role }}] {{ message.content }}\\n{% endfor %}"
    with caplog.at_level(logging.INFO, logger="sits.runtime.models.loading"):
        loaded = load_smollm2_with_template(inline)
    assert loaded.tokenizer.apply_chat_template(ASK) == "[user] When is high tide in Brest?\n"  # \\n decoded
    assert smollm2.tokenizer.chat_template is not None
    assert smollm2.tokenizer.apply_chat_template(ASK) != loaded.tokenizer.apply_chat_template(ASK)
    assert any("--chat-template inline" in record.getMessage() for record in caplog.records)


def test_the_model_template_is_logged_without_the_flag(smollm2_checkpoint_dir, caplog):
    with caplog.at_level(logging.INFO, logger="sits.runtime.models.loading"):
        loaded = load_model(ModelConfig(model=None, device="cpu"), TorchAttentionBackend(), progress=False)
    assert loaded.tokenizer.chat_template == (smollm2_checkpoint_dir / "chat_template.jinja").read_text()
    assert any("chat template: the model's own" in record.getMessage() for record in caplog.records)


def test_read_chat_template_tells_a_file_from_a_template(template_file, tmp_path):
    assert read_chat_template(str(template_file)) == (TOOLS_TEMPLATE, f"file {template_file}")
    assert read_chat_template("{{ messages[0].content }}")[0] == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match=r"^--chat-template 'missing\.jinja' is neither a readable file"):
        read_chat_template("missing.jinja")
    broken = tmp_path / "broken.jinja"
    broken.write_text("hello\n{% for m in messages %}{{ m }}", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^--chat-template \(file {broken}\) does not compile at line 2"):
        read_chat_template(str(broken))


def test_a_missing_template_file_is_a_one_line_error(capsys):
    assert main(["serve", "--chat-template", "no/such/template.jinja", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sits serve: error: --chat-template 'no/such/template.jinja'") and "\n" not in err


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_template_that_does_not_compile_stops_the_cli_with_one_line(command):
    argv = [sys.executable, "-m", "sits.runtime", command, "--chat-template", "{% if %}hi{% endif %}"]
    if command == "generate":
        argv.insert(4, "Hello")
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    err = result.stderr.strip()
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith(f"sits {command}: error: --chat-template (inline, 21 characters) does not compile at line 1: ")
