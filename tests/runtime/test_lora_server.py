"""LoRA adapters through the real server and the official `openai` client, as vLLM serves them: a
request picks an adapter by sending its name as `model`, `/v1/models` lists each adapter (its
`parent` the base model, its `root` the adapter's path), responses name the model asked for, and an
unknown model is OpenAI's 404. The adapter's completions equal the base model with the adapter
merged into its weights. `sits serve`'s LoRA flags fail as one line on stderr, exit code 2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from sits.runtime import cli
from sits.runtime.lora.config import LoraConfig, LoraModule
from tests.runtime.lora_helpers import hf_greedy, merged_hf_model, write_peft_adapter
from tests.support.serving import openai_client, serve_loaded

PROMPT = "The three primary colors are"
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> tuple[object, dict[str, Path]]:
    loaded = tiny
    root = tmp_path_factory.mktemp("served-adapters")
    return loaded, {"sql": write_peft_adapter(root / "sql", loaded.config, rank=8, alpha=16, seed=11),
                    "poet": write_peft_adapter(root / "poet", loaded.config, rank=4, alpha=4, seed=12,
                                               targets=("q_proj", "v_proj"))}


@pytest.fixture(scope="module")
def served(adapters):
    loaded, paths = adapters
    lora = LoraConfig(enable_lora=True, modules=[LoraModule("sql", str(paths["sql"])),
                                                 LoraModule("poet", str(paths["poet"]), "tiny-base")])
    with serve_loaded(loaded, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256, lora=lora) as served:
        yield served


@pytest.fixture(scope="module")
def lora_client(served) -> Iterator[openai.OpenAI]:
    yield openai_client(served[0])


def test_models_lists_the_base_and_each_adapter(lora_client, served, adapters):
    base = served[1].model_name
    cards = {card.id: card for card in lora_client.models.list().data}
    assert list(cards) == [base, "sql", "poet"]
    assert cards[base].parent is None
    assert (cards["sql"].parent, cards["sql"].root) == (base, "sql")  # no server path in root
    assert cards["poet"].parent == "tiny-base"  # the JSON form's base_model_name
    assert lora_client.models.retrieve("sql").root == "sql"
    with pytest.raises(openai.NotFoundError):
        lora_client.models.retrieve("no-such-adapter")


def test_completion_with_an_adapter_equals_its_merged_weights(lora_client, served, adapters, tiny_llama_dir):
    loaded, paths = adapters
    prompt_ids = loaded.tokenizer.encode(PROMPT)
    expected, _ = hf_greedy(merged_hf_model(tiny_llama_dir, paths["sql"]), prompt_ids, NEW_TOKENS)
    base_expected, _ = hf_greedy(merged_hf_model(tiny_llama_dir, None), prompt_ids, NEW_TOKENS)
    assert expected != base_expected
    for model, tokens in (("sql", expected), (served[1].model_name, base_expected)):
        answer = lora_client.completions.create(model=model, prompt=prompt_ids, max_tokens=NEW_TOKENS, temperature=0,
                                                extra_body={"min_tokens": NEW_TOKENS})
        assert answer.model == model
        assert answer.choices[0].text == loaded.tokenizer.decode(tokens), model
        assert answer.usage.completion_tokens == NEW_TOKENS
    streamed = lora_client.completions.create(model="sql", prompt=prompt_ids, max_tokens=NEW_TOKENS, temperature=0,
                                              extra_body={"min_tokens": NEW_TOKENS}, stream=True)
    chunks = list(streamed)
    assert {chunk.model for chunk in chunks} == {"sql"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == loaded.tokenizer.decode(expected)


def test_chat_with_an_adapter_streams_the_same_answer(lora_client, served):
    messages = [{"role": "user", "content": "Name a color."}]
    answers = {}
    for model in ("poet", "sql", served[1].model_name):
        whole = lora_client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS,
                                                    temperature=0, extra_body={"min_tokens": NEW_TOKENS})
        assert whole.model == model and whole.usage.completion_tokens == NEW_TOKENS
        chunks = list(lora_client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS,
                                                          temperature=0, extra_body={"min_tokens": NEW_TOKENS},
                                                          stream=True))
        assert {chunk.model for chunk in chunks} == {model}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
        answers[model] = whole.choices[0].message.content
    assert len(set(answers.values())) == 3, answers  # each adapter (and the base) answers its own way


def test_an_unknown_model_is_a_404_on_both_routes(lora_client):
    with pytest.raises(openai.NotFoundError) as error:
        lora_client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as error:
        lora_client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"


@pytest.mark.parametrize("argv", [
    ["--lora-modules", "a=/x"],
    ["--enable-lora", "--lora-modules", "a"],
    ["--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "1"],
    ["--enable-lora", "--max-lora-rank", "0"],
    ["--enable-lora", "--quantization", "int8"],
    ["--enable-lora", "--tensor-parallel-size", "2"],
    ["--enable-lora", "--lora-modules", "a=/no/such/adapter", "--num-blocks", "16"],
], ids=lambda argv: "-".join(argv)[:48])
def test_bad_lora_flags_exit_2_with_one_line(argv, capsys):
    code = cli.main(["serve", "--device", "cpu", "--port", "0", "--log-level", "error", *argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("sits serve: error: ") and "-lora" in lines[0]


def test_generate_answers_with_an_adapter(adapters, tiny_llama_dir, capsys):
    loaded, paths = adapters
    code = cli.main(["generate", PROMPT, "--model", str(tiny_llama_dir), "--device", "cpu", "--no-chat",
                     "--temperature", "0", "--max-tokens", str(NEW_TOKENS), "--num-blocks", "16", "--max-model-len", "64",
                     "--enable-lora", "--lora-modules", f"sql={paths['sql']}", "--lora", "sql"])
    expected, _ = hf_greedy(merged_hf_model(tiny_llama_dir, paths["sql"]), loaded.tokenizer.encode(PROMPT), NEW_TOKENS)
    assert code == 0
    assert capsys.readouterr().out == loaded.tokenizer.decode(expected) + "\n"
    code = cli.main(["generate", PROMPT, "--device", "cpu", "--lora", "sql"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and lines == ["sits generate: error: --lora sql: no such adapter in --lora-modules (none)"]
