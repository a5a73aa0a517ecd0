"""Structured outputs: OpenAI's response_format (json_object, json_schema) on SmolLM2-135M-Instruct.

The engine tests run the real model with a KV cache too small for its requests, so constrained
sequences are preempted and recompute their context: their matchers accept every output token
exactly once and the documents still validate. The server tests start SmolLM2 on CPU once for the
module and talk to it with the official `openai` client: json_object gives a JSON object, a schema's
output validates with `jsonschema` (greedy, sampled n=2, streamed), a constrained request batched
with an unconstrained one leaves the latter's tokens unchanged, max_tokens cuts a document short
with finish_reason "length", and bad response_formats are 400s naming response_format.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.request import FinishReason, SamplingParams
from sits.runtime.engine.structured_output import JSON_OBJECT, StructuredOutputError, json_schema_spec
from sits.runtime.server.runner import BackgroundServer
from tests.support.serving import serve_loaded, together

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON."}]
ASK_CAT = [{"role": "user", "content": "Return a JSON object with a cat's name."}]
ASK_CAT_AGE = [{"role": "user", "content": "Give a cat's name and age as a JSON object."}]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the engine ----------------------------------------------------------------------------------
def chat_prompt(loaded, messages) -> list[int]:
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def test_preempted_constrained_sequences_accept_each_token_once_and_stay_valid(smollm2):
    # 14 blocks of 8 tokens hold one ~70-token sequence but not three: they preempt one another.
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=104),
                          cache=CacheConfig(block_size=8, num_blocks=14),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    engine = LLMEngine.from_loaded(smollm2, config)
    prompt = chat_prompt(smollm2, ASK_PERSON)
    schema = SamplingParams(temperature=0.0, max_tokens=60, structured_output=json_schema_spec(PERSON))
    engine.add_request("schema", prompt, schema)
    engine.add_request("sampled", prompt, SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=60,
                                                         structured_output=json_schema_spec(PERSON)))
    finals = {}
    for _ in range(600):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        for seq_id in ("schema", "sampled#0", "sampled#1"):  # a matcher has seen each output token once
            seq = engine.scheduler.get_sequence(seq_id)
            grammar = seq.grammar if seq is not None else None
            if seq is not None and grammar is not None:
                assert grammar.num_accepted == len(seq.output_token_ids), seq_id
    assert set(finals) == {"schema", "sampled"}
    assert engine.stats().num_preemptions > 0
    for output in finals.values():
        for choice in output.outputs:
            assert choice.finish_reason is FinishReason.STOP, choice.text
            jsonschema.validate(json.loads(choice.text), PERSON)
    assert not engine.structured_outputs  # every matcher was released with its request


def test_async_scheduling_steps_constrained_batches_synchronously_with_the_same_tokens(smollm2):
    prompt = chat_prompt(smollm2, ASK_CAT)
    requests = {"json": SamplingParams(temperature=0.0, max_tokens=24, structured_output=JSON_OBJECT),
                "plain": SamplingParams(temperature=0.0, max_tokens=8)}
    tokens = {}
    for async_scheduling in (False, True):
        config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=128),
                              cache=CacheConfig(block_size=8, num_blocks=64), async_scheduling=async_scheduling)
        engine = LLMEngine.from_loaded(smollm2, config)
        for request_id, params in requests.items():
            engine.add_request(request_id, prompt, params)
        finals = {}
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        tokens[async_scheduling] = {request_id: output.token_ids for request_id, output in finals.items()}
        assert finals["json"].finish_reason is FinishReason.STOP
        assert isinstance(json.loads(finals["json"].text), dict)
    assert tokens[True] == tokens[False]


def test_bad_schemas_are_refused_before_any_work(smollm2):
    config = EngineConfig(model=ModelConfig(device="cpu", dtype="float32", max_model_len=64),
                          cache=CacheConfig(block_size=8, num_blocks=16))
    engine = LLMEngine.from_loaded(smollm2, config)
    with pytest.raises(StructuredOutputError) as error:
        engine.add_request("bad", [1, 2, 3], SamplingParams(
            structured_output=json_schema_spec({"type": "integer", "minimum": 5, "maximum": 1})))
    assert error.value.param == "response_format"
    with pytest.raises(StructuredOutputError):
        json_schema_spec([{"type": "string"}])
    assert not engine.has_unfinished_requests() and not engine.structured_outputs
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=2, structured_output=JSON_OBJECT))
    assert len(engine.structured_outputs) == 1


# -- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    with serve_loaded(smollm2, max_model_len=1024, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256) as served:
        yield served



def person_format(strict: bool | None = None) -> dict:
    schema = {"name": "person", "schema": PERSON}
    return {"type": "json_schema", "json_schema": schema if strict is None else {**schema, "strict": strict}}


def test_json_object_is_a_json_object(client, model):
    response = client.chat.completions.create(model=model, messages=ASK_CAT, max_tokens=40, temperature=0,
                                              response_format={"type": "json_object"})
    choice = response.choices[0]
    assert isinstance(json.loads(choice.message.content), dict), choice.message.content
    assert choice.finish_reason == "stop"


def test_a_json_schema_holds_greedy_and_sampled(client, model):
    greedy, sampled = together(
        lambda: client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=60, temperature=0,
                                               response_format=person_format(strict=True)),
        lambda: client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=60, temperature=1.0,
                                               seed=7, n=2, response_format=person_format()))
    choices = greedy.choices + sampled.choices
    assert len(choices) == 3
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content  # the grammar's end stops it
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_a_streamed_document_validates_once_joined(client, model):
    stream = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=60, temperature=0,
                                            stream=True, response_format=person_format())
    deltas, finishes = [], []
    for chunk in stream:
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finishes.append(choice.finish_reason)
    jsonschema.validate(json.loads("".join(deltas)), PERSON)
    assert finishes[-1] == "stop"


def test_completions_take_response_format_too(client, model):
    response = client.completions.create(model=model, prompt="A cat, as JSON:", max_tokens=30, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(response.choices[0].text), dict), response.choices[0].text


def test_max_tokens_cuts_the_document_with_finish_reason_length(client, model):
    response = client.chat.completions.create(model=model, messages=ASK_PERSON, max_tokens=4, temperature=0,
                                              response_format=person_format())
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):  # cut short, as OpenAI and vLLM leave it
        json.loads(choice.message.content)


def test_an_unconstrained_request_batched_with_a_constrained_one_keeps_its_tokens(client, model):
    plain = {"model": model, "messages": ASK_CAT, "max_tokens": 12, "temperature": 0}
    alone = client.chat.completions.create(**plain).choices[0].message.content
    started, last_chunk_at, document = threading.Event(), [0.0], []

    def run_constrained() -> None:
        stream = client.chat.completions.create(model=model, messages=ASK_CAT_AGE, max_tokens=60, temperature=0,
                                                stream=True, response_format={"type": "json_object"})
        for chunk in stream:
            started.set()
            document.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            last_chunk_at[0] = time.monotonic()

    constrained = threading.Thread(target=run_constrained)
    constrained.start()
    try:
        assert started.wait(60)
        together = client.chat.completions.create(**plain).choices[0].message.content
        plain_done_at = time.monotonic()
    finally:
        constrained.join(120)
    assert not constrained.is_alive()
    assert last_chunk_at[0] > plain_done_at  # the constrained request was still running: they shared steps
    assert together == alone
    assert isinstance(json.loads("".join(document)), dict)


@pytest.mark.parametrize("response_format", [
    {"type": "xml"}, "json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema", "json_schema": {"schema": PERSON}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}},
], ids=["unknown-type", "not-an-object", "no-json-schema", "no-schema", "no-name", "schema-not-an-object",
        "unknown-schema-type", "empty-range", "dangling-ref"])
def test_bad_response_formats_are_400s_naming_response_format(served, model, response_format):
    server, _ = served
    for path, body in (("/v1/chat/completions", {"messages": ASK_CAT}), ("/v1/completions", {"prompt": "A cat"})):
        for stream in (False, True):  # a stream too: refused before it starts
            response = httpx.post(f"{server.url}{path}", json={"model": model, "max_tokens": 2, **body,
                                                              "stream": stream, "response_format": response_format},
                                  timeout=60)
            assert response.status_code == 400, (path, stream, response.text)
            error = response.json()["error"]
            assert error["param"] == "response_format" and error["type"] == "invalid_request_error", error


def test_text_is_unconstrained_and_the_server_keeps_serving(client, model, served):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=ASK_CAT, max_tokens=2,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": 5}}})
    assert error.value.param == "response_format"
    text = client.chat.completions.create(model=model, messages=ASK_CAT, max_tokens=4, temperature=0,
                                          response_format={"type": "text"})
    plain = client.chat.completions.create(model=model, messages=ASK_CAT, max_tokens=4, temperature=0)
    assert text.choices[0].message.content == plain.choices[0].message.content
    assert httpx.get(f"{served[0].url}/health", timeout=10).status_code == 200
