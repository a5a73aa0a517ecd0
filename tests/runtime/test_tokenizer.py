"""Our tokenizer (rebuilt from SmolLM2's GGUF metadata, run on `tokenizers`) against transformers'
tokenizer read from the same file: ids, text, bytes and chat templates."""

from __future__ import annotations

import pytest

from sits.runtime.models.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world!",
    "The year 2024 had 365 days; pi is 3.14159.",
    "  leading spaces\n\n\ttabs and trailing   ",
    "émojis 🤖 and ünïcödé 中文, Ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # square\n",
    "don't it's we'll THEY'RE",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
     {"role": "user", "content": "Another one, in Français: ça va?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Arr!"}],
]


@pytest.fixture(scope="module")
def tok(smollm2_checkpoint_dir) -> Tokenizer:
    return Tokenizer.from_directory(smollm2_checkpoint_dir)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tok, hf_smollm2_tokenizer, add_special_tokens):
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens) == hf_smollm2_tokenizer.encode(
            text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tok, hf_smollm2_tokenizer, skip_special_tokens):
    for text in TEXTS:
        ids = hf_smollm2_tokenizer.encode(text)
        expected = hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_special_tokens_and_sizes(tok, hf_smollm2_tokenizer):
    assert tok.bos_token_id == hf_smollm2_tokenizer.bos_token_id == 1
    assert tok.eos_token_id == hf_smollm2_tokenizer.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({2})
    assert tok.vocab_size == len(hf_smollm2_tokenizer) == 49152
    assert set(hf_smollm2_tokenizer.all_special_ids) <= tok.all_special_ids
    assert set(range(17)) == tok.all_special_ids  # every control token of the GGUF file


def test_token_bytes_reassemble_the_text(tok):
    text = "naïve café 🤖 中文\n"
    ids = tok.encode(text)
    assert b"".join(tok.token_to_bytes(i) for i in ids) == text.encode("utf-8")
    partial = [i for i in ids if tok.token_to_bytes(i) != tok.token_to_text(i).encode("utf-8")]
    assert partial, "the emoji spans several byte tokens, none of which is valid UTF-8 alone"
    assert all("\ufffd" in tok.token_to_text(i) for i in partial)
    assert tok.token_to_text(tok.encode(" Paris")[0]) == " Paris"
    assert tok.token_to_text(2) == "<|im_end|>"
    assert tok.token_to_bytes(10**9) == tok.token_to_bytes(-1) == b""


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_smollm2_tokenizer, conversation, add_generation_prompt):
    expected = hf_smollm2_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_continue_final_message_matches_transformers(tok, hf_smollm2_tokenizer):
    conversation = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]
    expected = hf_smollm2_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True)
    assert rendered == expected and rendered.endswith("One, two,")


def test_template_helpers_match_transformers(tok, hf_smollm2_tokenizer):
    """raise_exception, tojson (non-ASCII kept), bos/eos variables and extra kwargs, as transformers has them."""
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('tool messages are not supported') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{{ greeting }}"
    )
    conversation = [{"role": "user", "content": "Grüße, \"quoted\""}]
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    expected = hf_smollm2_tokenizer.apply_chat_template(
        conversation, chat_template=template, tools=tools, tokenize=False, greeting="bonjour")
    ours = tok.with_chat_template(template)
    assert ours.apply_chat_template(conversation, tools=tools, greeting="bonjour") == expected

    with pytest.raises(ChatTemplateError, match="tool messages are not supported"):
        ours.apply_chat_template([{"role": "tool", "content": "42"}])
    with pytest.raises(Exception, match="tool messages are not supported"):
        hf_smollm2_tokenizer.apply_chat_template([{"role": "tool", "content": "42"}], chat_template=template,
                                                 tokenize=False)


def test_malformed_conversations_are_chat_template_errors(tok):
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user"}])  # no content: the template cannot concatenate it
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": None}])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template("not a list")
    with pytest.raises(ChatTemplateError):
        tok.with_chat_template("{% if %}").apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.with_chat_template(None).apply_chat_template([{"role": "user", "content": "x"}])


def test_from_file_with_a_config_dict(smollm2_checkpoint_dir):
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>",
              "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}!"}]}
    tok = Tokenizer.from_file(smollm2_checkpoint_dir / "tokenizer.json", config, extra_eos_token_ids=[0])
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, frozenset({0, 2}))
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
