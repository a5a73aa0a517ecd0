"""vLLM's chat rendering options and prompt truncation, through a real server and the official client.

SmolLM2-135M-Instruct is served with a ChatML template that also reads `documents` and a
`enable_thinking` variable (as Qwen3's does). The prompts the server renders are compared with
transformers' apply_chat_template of the same template and options, the chat endpoint's
prompt_tokens with /tokenize, and a continued assistant message with a plain completion of the
same rendered text; truncated prompts with the completions of their last tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.server.runner import BackgroundServer
from tests.support.models import load_smollm2_with_template
from tests.support.serving import serve_loaded

TEMPLATE = """\
{%- if documents %}<|im_start|>system
{% for document in documents %}[{{ document.title }}] {{ document.text }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
ASK = [{"role": "user", "content": "Name a color of the rainbow."}]
PREFILLED = [{"role": "user", "content": "List three colors of the rainbow."},
             {"role": "assistant", "content": "Sure: red, orange,"}]
DOCUMENTS = [{"title": "Tides", "text": "Brest has two high tides a day."}]
MAX_MODEL_LEN = 512
GREEDY = {"temperature": 0.0, "max_tokens": 8}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(smollm2_checkpoint_dir) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    with serve_loaded(load_smollm2_with_template(TEMPLATE), max_model_len=MAX_MODEL_LEN, num_blocks=64,
                      max_num_seqs=2, max_num_batched_tokens=256) as served:
        yield served


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0].url, timeout=120) as client:
        yield client


def reference_ids(hf_tokenizer, messages, **options) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **options)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def tokenize(http: httpx.Client, **body) -> list[int]:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


@pytest.mark.parametrize("options", [
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"documents": DOCUMENTS},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
], ids=["template-kwargs", "documents", "no-generation-prompt", "continue-final-message"])
def test_options_render_as_transformers_does_and_the_chat_endpoint_reads_that_prompt(
        http, client, model, hf_smollm2_tokenizer, options):
    messages = PREFILLED if options.get("continue_final_message") else ASK
    hf_options = {**options.get("chat_template_kwargs", {}), **{k: v for k, v in options.items()
                                                              if k != "chat_template_kwargs"}}
    hf_options.setdefault("add_generation_prompt", True)
    expected = reference_ids(hf_smollm2_tokenizer, messages, **hf_options)
    assert tokenize(http, messages=messages, **options) == expected
    completion = client.chat.completions.create(model=model, messages=messages, extra_body=options, **GREEDY)
    assert completion.usage.prompt_tokens == len(expected)


def test_template_kwargs_change_the_prompt(http):
    plain = tokenize(http, messages=ASK)
    without_thinking = tokenize(http, messages=ASK, chat_template_kwargs={"enable_thinking": False})
    assert without_thinking[:len(plain)] == plain and len(without_thinking) > len(plain)


def test_a_continued_message_is_completed_as_the_rendered_text_would_be(client, model, hf_smollm2_tokenizer):
    options = {"add_generation_prompt": False, "continue_final_message": True}
    prompt = hf_smollm2_tokenizer.apply_chat_template(PREFILLED, chat_template=TEMPLATE, tokenize=False, **options)
    assert prompt.endswith("red, orange,")  # the assistant's turn is left open
    chat = client.chat.completions.create(model=model, messages=PREFILLED, extra_body=options, **GREEDY)
    plain = client.completions.create(model=model, prompt=prompt, **GREEDY)
    assert chat.choices[0].message.content == plain.choices[0].text

    echoed = client.chat.completions.create(model=model, messages=PREFILLED, extra_body={**options, "echo": True},
                                            **GREEDY)
    assert echoed.choices[0].message.content == PREFILLED[-1]["content"] + plain.choices[0].text
    stream = client.chat.completions.create(model=model, messages=PREFILLED, stream=True,
                                            extra_body={**options, "echo": True}, **GREEDY)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == echoed.choices[0].message.content


def test_echo_after_a_user_message_adds_nothing(client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, **GREEDY)
    echoed = client.chat.completions.create(model=model, messages=ASK, extra_body={"echo": True}, **GREEDY)
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_truncated_prompts_keep_their_last_tokens(client, model, http):
    text = "one two three four five six seven eight nine ten eleven twelve"
    ids = tokenize(http, prompt=text)
    assert len(ids) > 6
    truncated = client.completions.create(model=model, prompt=text, extra_body={"truncate_prompt_tokens": 5},
                                          **GREEDY)
    tail = client.completions.create(model=model, prompt=ids[-5:], **GREEDY)
    assert truncated.usage.prompt_tokens == 5
    assert truncated.choices[0].text == tail.choices[0].text
    echoed = client.completions.create(model=model, prompt=ids, echo=True, **GREEDY,
                                       extra_body={"truncate_prompt_tokens": 5})
    kept_text = http.post("/detokenize", json={"tokens": ids[-5:]}).json()["prompt"]
    assert echoed.choices[0].text == kept_text + tail.choices[0].text

    chat = client.chat.completions.create(model=model, messages=ASK, extra_body={"truncate_prompt_tokens": 4},
                                          **GREEDY)
    assert chat.usage.prompt_tokens == 4


def test_minus_one_keeps_what_fits_of_a_prompt_longer_than_the_context(client, model):
    too_long = list(range(1000, 1000 + MAX_MODEL_LEN + 50))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=too_long, max_tokens=8)
    fitted = client.completions.create(model=model, prompt=too_long, max_tokens=8, temperature=0.0,
                                       extra_body={"truncate_prompt_tokens": -1})
    assert fitted.usage.prompt_tokens == MAX_MODEL_LEN - 8
    assert fitted.usage.completion_tokens <= 8


@pytest.mark.parametrize(("body", "param"), [
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"documents": [{"title": 3}]}, "documents[0].title"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"echo": "yes"}, "echo"),
])
def test_bad_options_are_a_400_naming_the_param(http, body, param):
    response = http.post("/v1/chat/completions", json={"messages": PREFILLED, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if param == "continue_final_message":  # /tokenize renders by the same rules
        tokenized = http.post("/tokenize", json={"messages": PREFILLED, **body})
        assert tokenized.status_code == 400 and tokenized.json()["error"]["param"] == param
