"""The OpenAI-compatible server through a real uvicorn server, the official `openai` client and httpx.

One server (SmolLM2-135M-Instruct on CPU) is started for the whole module and stopped afterwards.
Greedy decoding makes outputs comparable across streamed / non-streamed calls and both APIs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sits.runtime.config import ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.server.request_ids import uuid7_time
from sits.runtime.server.runner import BackgroundServer
from tests.support.serving import serve_loaded

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    with serve_loaded(smollm2, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=512,
                      server_config=ServerConfig(track="canary")) as served:
        yield served



def metric_value(server: BackgroundServer, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_models_lists_and_retrieves_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_stream_equals_non_stream_with_usage_in_the_last_chunk(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    text = whole.choices[0].message.content
    assert "Paris" in text
    assert whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completions_stream_equals_non_stream(client, model):
    whole = client.completions.create(model=model, prompt="The three primary colors are", max_tokens=10,
                                      temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=model, prompt="The three primary colors are", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_n2_with_logprobs_in_the_chat_shape(client, model):
    result = client.chat.completions.create(model=model, messages=QUESTION, n=2, max_completion_tokens=5,
                                            temperature=0.9, seed=3, logprobs=True, top_logprobs=3)
    assert sorted(c.index for c in result.choices) == [0, 1]
    total = 0
    for choice in result.choices:
        content = choice.logprobs.content
        total += len(content)
        assert "".join(entry.token for entry in content) == choice.message.content
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert total == result.usage.completion_tokens


def test_completions_batch_of_prompts_with_n2_and_legacy_logprobs(client, model, served):
    prompts = ["Once upon a time", "The sky is"]
    result = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=6, temperature=0, logprobs=2)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    by_index = {c.index: c for c in result.choices}
    assert by_index[0].text == by_index[1].text and by_index[2].text == by_index[3].text  # greedy
    for choice in result.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
        assert "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
        assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert result.usage.completion_tokens == 4 * 6

    token_ids = served[1].tokenizer.encode(prompts[1], add_special_tokens=True)
    by_ids = client.completions.create(model=model, prompt=token_ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_index[2].text
    assert by_ids.usage.prompt_tokens == len(token_ids)


def test_stop_strings_end_the_text_before_the_stop(client, model):
    free = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    text = free.choices[0].message.content
    stop = "Paris"
    assert stop in text
    stopped = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                             stop=[stop])
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    chunks = list(client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                            stop=" 7", stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert " 7" not in streamed and streamed.startswith(" 5")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client, model):
    def sample() -> str:
        result = client.completions.create(model=model, prompt="My favourite animal is", max_tokens=8,
                                           temperature=1.0, seed=1234)
        return result.choices[0].text

    assert sample() == sample()


def test_max_completion_tokens_and_max_tokens_limit_the_output(client, model):
    result = client.chat.completions.create(model=model, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert result.usage.completion_tokens == 3 and result.choices[0].finish_reason == "length"
    result = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0)
    assert result.usage.completion_tokens == 2


def test_chat_prompt_is_the_transformers_chat_template(client, model, hf_smollm2_tokenizer):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "Apple."},
                {"role": "user", "content": "Another one, please: ünïcode 🍓?"}]
    rendered = hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    reference_ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    via_chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    via_ids = client.completions.create(model=model, prompt=reference_ids, max_tokens=6, temperature=0)
    assert via_chat.usage.prompt_tokens == len(reference_ids)
    assert via_chat.choices[0].message.content == via_ids.choices[0].text


def test_text_content_parts_and_the_developer_role_are_accepted(client, model):
    plain = client.chat.completions.create(
        model=model, max_tokens=3, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}])
    parts = client.chat.completions.create(
        model=model, max_tokens=3, temperature=0,
        messages=[{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]}])
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_repeated_long_prompt_hits_the_prefix_cache(client, model, served):
    server, _ = served
    prompt = "Here is a long list of facts about the ocean. " * 30  # ~300 tokens: many full blocks
    hits_before = metric_value(server, "sits_prefix_cache_hits_total")
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    assert second.choices[0].logprobs.tokens == first.choices[0].logprobs.tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 256
    assert metric_value(server, "sits_prefix_cache_hits_total") - hits_before >= cached
    assert metric_value(server, "sits_prefix_cache_queries_total") >= 2 * first.usage.prompt_tokens - 16


def test_client_leaving_mid_stream_aborts_and_frees_every_block(served, model):
    server, engine = served
    gone_before = metric_value(server, "sits_requests_total", status="499")
    aborted_before = engine.stats().num_aborted
    body = {"model": model, "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                               json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert received and engine.stats().num_running == 1
    # The connection is closed: the server aborts the request and the engine frees its blocks.
    wait_until(lambda: engine.stats().num_aborted > aborted_before)
    wait_until(lambda: engine.stats().num_requests == 0 and engine.stats().kv_blocks_used == 0)
    wait_until(lambda: metric_value(server, "sits_requests_total", status="499") > gone_before)


def test_client_leaving_a_non_stream_request_aborts_it(served, model):
    server, engine = served
    aborted_before = engine.stats().num_aborted
    body = {"model": model, "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    wait_until(lambda: engine.stats().num_aborted > aborted_before)
    wait_until(lambda: engine.stats().num_requests == 0 and engine.stats().kv_blocks_used == 0)


def test_metrics_count_engine_steps_and_the_cpu_of_engine_and_server(served, client, model):
    """What `sits bench serve` reads to tell a slow GPU step from a busy API process: the engine's steps and its
    process's CPU seconds (model and track labels), and this process's own CPU (prometheus_client's names)."""
    server, _ = served
    steps, engine_cpu = metric_value(server, "sits_engine_steps_total"), metric_value(server, "sits_engine_cpu_seconds_total")
    client.completions.create(model=model, prompt="One, two,", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert metric_value(server, "sits_engine_steps_total", model=model, track="canary") >= steps + 6
    assert metric_value(server, "sits_engine_cpu_seconds_total") > engine_cpu
    assert metric_value(server, "process_cpu_seconds_total") > 0.0


def test_metrics_expose_every_metric_with_model_tenant_track_labels(served, client, model):
    server, _ = served
    client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3, temperature=0)
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    expected = ["sits_request_latency_seconds_bucket", "sits_time_to_first_token_seconds_bucket",
                "sits_time_per_output_token_seconds_bucket", "sits_prompt_tokens_total",
                "sits_generation_tokens_total", "sits_requests_total", "sits_requests_running",
                "sits_requests_waiting", "sits_kv_cache_usage_ratio", "sits_prefix_cache_queries_total",
                "sits_prefix_cache_hits_total", "sits_preemptions_total"]
    for name in expected:
        assert name in samples, f"{name} missing from /metrics"
        labels = samples[name][0]
        assert labels["model"] == model and labels["track"] == "canary" and labels["tenant"], name
    assert any(labels.get("status") == "200" and labels["tenant"] == "default"
               for labels in samples["sits_requests_total"])
    buckets = {float(labels["le"]) for labels in samples["sits_request_latency_seconds_bucket"]}
    assert min(buckets) <= 0.005 and 60.0 in buckets


def test_every_response_carries_a_time_ordered_request_id(served, model):
    server, _ = served
    response = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
    request_id = response.headers["x-request-id"]
    assert response.json()["id"] == request_id and request_id.startswith("cmpl-")
    assert abs(uuid7_time(request_id) - time.time()) < 60
