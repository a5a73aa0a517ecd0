"""Tool calling on /v1/chat/completions with SmolLM2-135M-Instruct and the official `openai` client.

A named tool_choice constrains the output to the function's parameters schema and returns one call
(greedy, sampled, streamed); "required" returns one or more calls, each valid for its tool; "none"
is plain text; a conversation holding an assistant's tool_calls and a tool's result renders and
completes; the hermes parser reads `<tool_call>` blocks out of text, whole and streamed with tags
split across deltas; bad tools / tool_choice are 400s naming the param, and the server keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from sits.runtime.config import ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.server.hermes import HermesParser, ParsedCall, parse_hermes
from sits.runtime.server.runner import BackgroundServer
from tests.support.serving import serve_loaded, together

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 10}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serve_loaded(smollm2, max_model_len=1024, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256,
                      server_config=config) as served:
        yield served


def assert_valid_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- forced calls: named and required --------------------------------------------------------------
def test_a_named_tool_choice_returns_one_valid_call_greedy_and_sampled(client, model):
    greedy, sampled = together(
        lambda: client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=WEATHER_CHOICE,
                                               max_tokens=40, temperature=0),
        lambda: client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=WEATHER_CHOICE,
                                               max_tokens=40, temperature=1.0, seed=3, n=2))
    for choice in greedy.choices + sampled.choices:
        assert choice.finish_reason == "stop", choice.message  # OpenAI's answer to a forced named call
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls, ["get_weather"])


def test_required_returns_calls_each_valid_for_its_tool(client, model):
    response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=60, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)


def stream_calls(stream) -> tuple[dict[int, dict], list[str | None], str]:
    """Deltas assembled as the openai client's stream helpers do: by index, arguments appended."""
    calls: dict[int, dict] = {}
    finishes, content = [], ""
    for chunk in stream:
        for choice in chunk.choices:
            finishes.append(choice.finish_reason)
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or ():
                call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
                if part.id:
                    assert call["id"] is None, "a call's id comes once, in its first delta"
                    call["id"], call["name"] = part.id, part.function.name
                call["arguments"] += part.function.arguments or ""
    return calls, finishes, content


@pytest.mark.parametrize("tool_choice", [WEATHER_CHOICE, "required"], ids=["named", "required"])
def test_streamed_calls_assemble_into_valid_calls(client, model, tool_choice):
    stream = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                            max_tokens=60, temperature=0, stream=True)
    calls, finishes, content = stream_calls(stream)
    # OpenAI's finish reasons: "stop" for a forced named call, "tool_calls" for required
    assert finishes[-1] == ("stop" if tool_choice == WEATHER_CHOICE else "tool_calls") and content == ""
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=60, temperature=0).choices[0].message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_conversation_with_a_call_and_its_result_renders_and_completes(client, model):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                              max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")


def test_none_is_plain_text_with_the_tools_in_the_prompt(client, model):
    response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=8, temperature=0)
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content
    assert response.choices[0].finish_reason == "length"
    # SmolLM2's template does not render tools, so the text is the plain one
    assert response.choices[0].message.content == plain.choices[0].message.content


def test_auto_with_the_hermes_parser_returns_plain_text_as_content(client, model):
    response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert choice.message.content and choice.message.tool_calls is None
    stream = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0,
                                            stream=True)
    calls, finishes, content = stream_calls(stream)
    assert calls == {} and content == choice.message.content and finishes[-1] == choice.finish_reason


# -- the hermes parser ---------------------------------------------------------------------------
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_B = '<tool_call>{"name": "get_time", "arguments": {"timezone": "CET"}}</tool_call>'


def test_hermes_reads_zero_one_and_two_calls():
    assert parse_hermes("Just text.") == ("Just text.", [])
    content, calls = parse_hermes(CALL_A)
    assert content is None
    assert calls == [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    content, calls = parse_hermes("Let me check.\n" + CALL_A + "\n" + CALL_B + "\n")
    assert content == "Let me check.\n"
    assert [call.name for call in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {"timezone": "CET"}


def test_hermes_leaves_malformed_json_as_content():
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert parse_hermes(broken) == (broken, [])
    assert parse_hermes("<tool_call>[1, 2]</tool_call>") == ("<tool_call>[1, 2]</tool_call>", [])
    content, calls = parse_hermes(broken + CALL_B)
    assert content == broken and [call.name for call in calls] == ["get_time"]
    unclosed = '<tool_call>{"name": "get_time", "arguments": {}}'  # cut off before the closing tag
    assert parse_hermes(unclosed) == (None, [ParsedCall("get_time", "{}")])
    assert parse_hermes("<tool_call>{\"name\": ") == ("<tool_call>{\"name\": ", [])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 12])
def test_hermes_streamed_in_pieces_that_split_the_tags_reads_the_same(size):
    text = "Sure <tool_ok> " + CALL_A + "\n" + CALL_B
    parser = HermesParser()
    events = []
    for start in range(0, len(text), size):
        events += parser.feed(text[start:start + size])
    events += parser.finish()
    content = "".join(event for event in events if isinstance(event, str))
    calls = [event for event in events if isinstance(event, ParsedCall)]
    assert (content, calls) == parse_hermes(text)
    assert content == "Sure <tool_ok> " and [call.name for call in calls] == ["get_weather", "get_time"]


# -- errors ----------------------------------------------------------------------------------------
BAD = [
    ("tools-not-a-list", {"tools": {"type": "function"}}, "tools"),
    ("tool-type-unknown", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ("tool-without-name", {"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools"),
    ("duplicate-names", {"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ("parameters-not-an-object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools"),
    ("parameters-a-string-schema",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ("unknown-named-function", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("unknown-choice", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("choice-not-an-object", {"tools": TOOLS, "tool_choice": {"name": "get_time"}}, "tool_choice"),
    ("choice-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("choice-and-response-format",
     {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize(("extra", "param"), [(extra, param) for _, extra, param in BAD], ids=[b[0] for b in BAD])
def test_bad_tools_and_tool_choice_are_400s_naming_the_param(served, model, extra, param):
    for stream in (False, True):
        response = httpx.post(f"{served[0].url}/v1/chat/completions", timeout=60,
                              json={"model": model, "messages": ASK, "max_tokens": 2, "stream": stream, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_auto_without_a_parser_is_a_400_that_says_how_to_enable_it(smollm2):
    with serve_loaded(smollm2, max_model_len=256, num_blocks=32, max_num_seqs=2,
                      max_num_batched_tokens=64) as (server, engine):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for tool_choice, param in ((openai.NOT_GIVEN, "tools"), ("auto", "tool_choice")):
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(model=engine.model_name, messages=ASK, tools=TOOLS,
                                               tool_choice=tool_choice, max_tokens=2)
            assert error.value.param == param and "--enable-auto-tool-choice" in error.value.message
        named = client.chat.completions.create(model=engine.model_name, messages=ASK, tools=TOOLS,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               max_tokens=30, temperature=0)
        assert_valid_calls(named.choices[0].message.tool_calls, ["get_time"])


def test_the_server_keeps_serving_after_bad_requests(client, model, served):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, tools=[TOOLS[0], TOOLS[0]], max_tokens=2)
    ok = client.chat.completions.create(model=model, messages=ASK, max_tokens=2)
    assert ok.choices[0].message.content
    assert httpx.get(f"{served[0].url}/health", timeout=10).status_code == 200
