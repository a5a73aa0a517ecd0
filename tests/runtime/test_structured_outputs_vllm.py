"""vLLM's structured-output parameters (`structured_outputs` and the older `guided_*`) on SmolLM2-135M-Instruct.

The real server runs SmolLM2 on CPU once for the module; the official `openai` client sends the
parameters through `extra_body`, as vLLM users do. A regex's output matches it whole (greedy, sampled
n=2, streamed, on both routes); a choice's output is one of the choices, quotes, backslashes, regex
metacharacters and non-ASCII included; a grammar's output parses (checked with the equivalent Python
regex); a JSON schema's output validates with `jsonschema`; each guided_* alias does the same; every
constrained completion ends with finish_reason "stop". Bad constraints, and two constraints at once,
are 400s in OpenAI's error shape naming the param the client sent, refused before a stream starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.structured_output import StructuredOutputError, grammar_spec, regex_spec
from sits.runtime.server.runner import BackgroundServer
from tests.support.serving import serve_loaded, together

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PHONE = r"[0-9]{3}-[0-9]{4}"  # means the same to xgrammar and to Python's re
ASK_PHONE = [{"role": "user", "content": "Give me a phone number."}]
SPECIAL_CHOICES = ['say "yes"', "no (a|b).*?", "C:\\path\\[x]+", "naïve ☕ $^"]
ASK_CHOICE = [{"role": "user", "content": "Pick one answer."}]
ARITHMETIC = 'root ::= num " " op " " num\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
ARITHMETIC_RE = r"[1-9][0-9]? [+*-] [1-9][0-9]?"  # the grammar's language, as a Python regex
ASK_SUM = [{"role": "user", "content": "Write a small arithmetic expression."}]
CAT = {"type": "object",
       "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 20}},
       "required": ["name", "age"]}
ASK_CAT = [{"role": "user", "content": "Give a cat's name and age as JSON."}]


@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    with serve_loaded(smollm2, max_model_len=512, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=256) as served:
        yield served


def chat_texts(client, model, messages, extra_body, **kwargs) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice of a chat completion, streamed when kwargs say so."""
    request = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0, **kwargs}
    if not request.get("stream"):
        response = client.chat.completions.create(**request, extra_body=extra_body)
        return [(choice.message.content, choice.finish_reason) for choice in response.choices]
    texts: dict[int, list[str]] = {}
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(**request, extra_body=extra_body):
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    return [("".join(texts[i]), finishes.get(i, "")) for i in sorted(texts)]


# -- regex -------------------------------------------------------------------------------------
def test_a_regex_matches_whole_greedy_sampled_and_streamed(client, model):
    constraint = {"structured_outputs": {"regex": PHONE}}
    outputs = sum(together(lambda: chat_texts(client, model, ASK_PHONE, constraint),
                           lambda: chat_texts(client, model, ASK_PHONE, constraint, temperature=1.0, seed=3, n=2),
                           lambda: chat_texts(client, model, ASK_PHONE, constraint, stream=True)), [])
    assert len(outputs) == 4
    for text, finish in outputs:
        assert re.fullmatch(PHONE, text), text
        assert finish == "stop", text


def test_completions_take_structured_outputs_and_guided_regex(client, model):
    for extra_body in ({"structured_outputs": {"regex": PHONE}}, {"guided_regex": PHONE}):
        response = client.completions.create(model=model, prompt="Call me at", max_tokens=16, temperature=0,
                                             extra_body=extra_body)
        choice = response.choices[0]
        assert re.fullmatch(PHONE, choice.text), (extra_body, choice.text)
        assert choice.finish_reason == "stop"
    stream = client.completions.create(model=model, prompt="Call me at", max_tokens=16, temperature=0.9, seed=1,
                                       stream=True, extra_body={"guided_regex": PHONE})
    chunks = list(stream)
    assert re.fullmatch(PHONE, "".join(c.choices[0].text for c in chunks if c.choices))
    assert chunks[-1].choices[0].finish_reason == "stop"


# -- choice ------------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint", [{"structured_outputs": {"choice": SPECIAL_CHOICES}},
                                        {"guided_choice": SPECIAL_CHOICES}], ids=["structured_outputs", "guided"])
def test_a_choice_is_one_of_the_choices_special_characters_and_all(client, model, constraint):
    outputs = sum(together(
        lambda: chat_texts(client, model, ASK_CHOICE, constraint),
        lambda: chat_texts(client, model, ASK_CHOICE, constraint, temperature=1.0, seed=11, n=2, stream=True)), [])
    for text, finish in outputs:
        assert text in SPECIAL_CHOICES, text
        assert finish == "stop", text


def test_plain_choices_on_completions(client, model):
    response = client.completions.create(model=model, prompt="Is the sky blue? Answer:", max_tokens=8, n=2,
                                         temperature=1.0, seed=5,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert [c.text in ("yes", "no", "maybe") and c.finish_reason == "stop" for c in response.choices] == [True] * 2


# -- grammar -----------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint", [{"structured_outputs": {"grammar": ARITHMETIC}}, {"guided_grammar": ARITHMETIC}],
                         ids=["structured_outputs", "guided"])
def test_a_grammar_output_parses(client, model, constraint):
    outputs = sum(together(lambda: chat_texts(client, model, ASK_SUM, constraint),
                           lambda: chat_texts(client, model, ASK_SUM, constraint, temperature=1.0, seed=2, stream=True)),
                  [])
    for text, finish in outputs:
        assert re.fullmatch(ARITHMETIC_RE, text), text
        assert finish == "stop", text


# -- JSON --------------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint", [
    {"structured_outputs": {"json": CAT, "disable_any_whitespace": True, "disable_additional_properties": True}},
    {"structured_outputs": {"json": json.dumps(CAT)}},
    {"guided_json": CAT, "guided_decoding_backend": "xgrammar"},
    {"guided_json": json.dumps(CAT), "guided_decoding_backend": "auto"},
], ids=["object", "string", "guided", "guided-string"])
def test_a_json_schema_validates(client, model, constraint):
    (text, finish), = chat_texts(client, model, ASK_CAT, constraint, max_tokens=40)
    jsonschema.validate(json.loads(text), CAT)
    assert finish == "stop"


def test_json_object_gives_an_object(client, model):
    response = client.completions.create(model=model, prompt="A cat, as JSON:", max_tokens=30, temperature=0,
                                         extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(response.choices[0].text), dict), response.choices[0].text
    assert response.choices[0].finish_reason == "stop"


# -- errors ------------------------------------------------------------------------------------
BAD = [
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"structured_outputs": {"regex": PHONE, "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": PHONE, "whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_regex": "(?P<area>[0-9])"}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", None]}, "guided_choice"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_regex": PHONE, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_json": CAT, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    # two constraints at once: the second is named
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"json_object": True}}, "structured_outputs"),
    ({"structured_outputs": {"regex": PHONE}, "guided_regex": PHONE}, "guided_regex"),
    ({"guided_regex": PHONE, "guided_choice": ["a"]}, "guided_choice"),
]


@pytest.mark.parametrize(("constraint", "param"), BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_constraints_are_400s_naming_the_param(served, model, constraint, param):
    server, _ = served
    for path, body in (("/v1/chat/completions", {"messages": ASK_PHONE}), ("/v1/completions", {"prompt": "Call"})):
        for stream in (False, True):  # a stream too: refused before it starts
            response = httpx.post(f"{server.url}{path}", timeout=60,
                                  json={"model": model, "max_tokens": 2, "stream": stream, **body, **constraint})
            assert response.status_code == 400, (path, stream, response.text)
            assert response.headers["content-type"].startswith("application/json")
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["param"] == param and error["type"] == "invalid_request_error", error
            assert param in error["message"], error


def test_a_forced_tool_call_takes_no_other_constraint(client, model):
    tools = [{"type": "function", "function": {"name": "dial", "parameters": {"type": "object"}}}]
    for choice in ("required", {"type": "function", "function": {"name": "dial"}}):
        for constraint, param in (({"structured_outputs": {"regex": PHONE}}, "structured_outputs"),
                                  ({"guided_choice": ["a"]}, "guided_choice")):
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(model=model, messages=ASK_PHONE, max_tokens=2, tools=tools,
                                               tool_choice=choice, extra_body=constraint)
            assert error.value.param == param


def test_one_compiled_grammar_per_kind_and_text_and_errors_name_their_field(served):
    cache = served[1].structured_outputs.cache
    assert cache.compile(regex_spec(PHONE, "guided_regex")) is cache.compile(regex_spec(PHONE, "structured_outputs.regex"))
    assert cache.compile(grammar_spec(ARITHMETIC, "guided_grammar")) is not cache.compile(regex_spec(PHONE, "guided_regex"))
    with pytest.raises(StructuredOutputError) as error:
        cache.compile(regex_spec("a{3,1}", "structured_outputs.regex"))
    assert error.value.param == "structured_outputs"
    assert str(error.value).startswith("structured_outputs.regex cannot be enforced: ")
    assert "/project/" not in str(error.value)  # xgrammar's log prefix is dropped


def test_the_server_keeps_serving_after_refusals(client, model, served):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"guided_regex": "("})
    response = client.completions.create(model=model, prompt="Call me at", max_tokens=4, temperature=0,
                                         extra_body={"structured_outputs": None})
    assert response.choices[0].finish_reason == "length"
    assert httpx.get(f"{served[0].url}/health", timeout=10).status_code == 200
