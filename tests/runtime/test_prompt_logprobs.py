"""`echo` and prompt logprobs on /v1/completions (OpenAI's legacy semantics, as vLLM serves them).

The server runs SmolLM2-135M-Instruct on CPU with async scheduling and an 8-token step budget, so
every prompt here is split over several prefill chunks; the official `openai` client talks to it.
Prompt logprobs are compared with transformers' log-softmax of the same GGUF at float32, for a
split prompt and for the same prompt sent again (its blocks are in the prefix cache by then: a
request that scores its prompt takes no hits and recomputes). Engine parts are checked directly
where the server cannot show them: steps without such a request list no rows to score, and a
rescored prompt (after preemption) keeps its first scores.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
import torch

from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.input_batch import InputBatch
from sits.runtime.engine.output_processor import OutputProcessor
from sits.runtime.engine.request import RequestMetrics, SamplingParams, TokenLogprob
from sits.runtime.engine.scheduler_output import ScheduledSequence, SequenceUpdate
from sits.runtime.engine.sequence import Sequence, SequenceStatus
from sits.runtime.server.runner import BackgroundServer
from tests.support.serving import serve_loaded

BUDGET = 8  # tokens per step: the prompt below takes 5 chunks
PROMPT = ("The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions. It extends from "
          "the Arctic Ocean in the north to the Southern Ocean in the south, and it")


@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    with serve_loaded(smollm2, max_model_len=256, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=BUDGET,
                      async_scheduling=True) as served:
        yield served



@pytest.fixture(scope="module")
def prompt_ids(served) -> list[int]:
    ids = served[1].tokenizer.encode(PROMPT)
    assert len(ids) > 32  # split over several steps, and two full KV blocks for the prefix cache
    return ids


@pytest.fixture(scope="module")
def reference(hf_smollm2, prompt_ids) -> torch.Tensor:
    """transformers' [len - 1, vocab] log-softmax: row i predicts prompt token i + 1."""
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def texts(served, ids: list[int]) -> list[str]:
    return [served[1].tokenizer.token_to_text(token_id) for token_id in ids]


def assert_offsets_follow_tokens(logprobs, text: str) -> None:
    expected = [sum(len(token) for token in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.text_offset == expected
    assert "".join(logprobs.tokens) == text


def assert_prompt_matches(served, logprobs, prompt_ids: list[int], reference: torch.Tensor, k: int) -> None:
    n = len(prompt_ids)
    assert logprobs.tokens[:n] == texts(served, prompt_ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference.gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:n]), expected, atol=1e-3, rtol=0)
    top_values = reference.topk(k, dim=-1).values
    for i in range(1, n):
        top = logprobs.top_logprobs[i]
        chosen = logprobs.tokens[i]
        assert top[chosen] == pytest.approx(logprobs.token_logprobs[i])  # the chosen token is always there
        assert len(top) in (k, k + 1)  # the k best, and the chosen one when it is not among them
        best = sorted(top.values(), reverse=True)[:k]
        torch.testing.assert_close(torch.tensor(best), top_values[i - 1], atol=1e-3, rtol=0)


def test_echo_logprobs_of_a_split_prompt_match_transformers_also_from_the_prefix_cache(
        served, client, model, prompt_ids, reference):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=1)  # the prompt's blocks: in the cache now
    for attempt in range(2):
        result = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, logprobs=2, echo=True,
                                           temperature=0)
        choice = result.choices[0]
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt_ids) + 1
        assert_prompt_matches(served, logprobs, prompt_ids, reference, k=2)
        assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
        assert_offsets_follow_tokens(logprobs, choice.text)
        assert result.usage.completion_tokens == 1 and result.usage.prompt_tokens == len(prompt_ids)
        assert result.usage.prompt_tokens_details.cached_tokens == 0  # scored prompts take no cache hits
        if attempt == 0:
            first = logprobs
    assert logprobs.token_logprobs == first.token_logprobs and logprobs.tokens == first.tokens
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # the cache held the prompt all along


def test_echo_text_is_prompt_then_completion_for_each_of_n(client, model, prompt_ids):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=7,
                                        echo=True, logprobs=0)
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    for choice in sampled.choices:
        assert choice.text.startswith(PROMPT)
        assert choice.logprobs.token_logprobs[0] is None
        assert 1 <= len(choice.logprobs.tokens) - len(prompt_ids) <= 4
        assert_offsets_follow_tokens(choice.logprobs, choice.text)
    # Both choices carry the same prompt logprobs (completion 0 scored them once).
    first, second = (c.logprobs.token_logprobs[:len(prompt_ids)] for c in sampled.choices)
    assert first == second


def test_max_tokens_0_with_echo_returns_exactly_the_prompt(served, client, model, prompt_ids, reference):
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = result.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert_prompt_matches(served, choice.logprobs, prompt_ids, reference, k=1)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert chunks[-1].choices[0].finish_reason == "length"
    by_ids = client.completions.create(model=model, prompt=prompt_ids, max_tokens=0, echo=True)
    assert by_ids.choices[0].text == PROMPT  # token ids echo as their text
    # lm-evaluation-harness's local-completions body: a batch of prompts, older versions' max_tokens 0
    batch = httpx.post(f"{served[0].url}/v1/completions", timeout=120, json={
        "model": model, "prompt": [PROMPT, "Hello there"], "max_tokens": 0, "logprobs": 1, "echo": True,
        "temperature": 0}).json()
    assert [c["text"] for c in sorted(batch["choices"], key=lambda c: c["index"])] == [PROMPT, "Hello there"]
    assert all(c["logprobs"]["token_logprobs"][0] is None and c["logprobs"]["top_logprobs"][0] is None
               for c in batch["choices"])


def test_streamed_echo_carries_the_prompt_first_and_adds_up_to_the_whole(served, client, model, prompt_ids):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                      logprobs=1).choices[0]
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert parts[0].text.startswith(PROMPT)
    assert parts[0].logprobs.tokens[:len(prompt_ids)] == texts(served, prompt_ids)
    assert "".join(p.text for p in parts) == whole.text
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p.logprobs, field)] == getattr(whole.logprobs, field)
    assert parts[-1].finish_reason == whole.finish_reason


def test_plain_requests_batched_with_echo_keep_their_tokens(client, model):
    story = "Once upon a time"
    alone = client.completions.create(model=model, prompt=story, max_tokens=24, temperature=0, logprobs=0)
    started, chunks = threading.Event(), []

    def run_plain() -> None:
        for chunk in client.completions.create(model=model, prompt=story, max_tokens=24, temperature=0, logprobs=0,
                                               stream=True):
            started.set()
            chunks.append(chunk.choices[0])

    plain = threading.Thread(target=run_plain)
    plain.start()
    try:
        assert started.wait(60)
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=3)
    finally:
        plain.join(120)
    assert "".join(c.text for c in chunks) == alone.choices[0].text
    assert [t for c in chunks for t in c.logprobs.tokens] == alone.choices[0].logprobs.tokens
    # the same up to float rounding (a batch of other shapes sums in another order)
    assert [t for c in chunks for t in c.logprobs.token_logprobs] == pytest.approx(
        alone.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_vllm_prompt_logprobs_on_both_routes(served, client, model, prompt_ids, reference):
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    scores = result.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == len(prompt_ids) and scores[0] is None
    for i, entry in enumerate(scores[1:], start=1):
        mine = entry[str(prompt_ids[i])]
        assert mine["logprob"] == pytest.approx(float(reference[i - 1, prompt_ids[i]]), abs=1e-3)
        assert mine["rank"] == int((reference[i - 1] > reference[i - 1, prompt_ids[i]]).sum()) + 1
        assert mine["decoded_token"] == served[1].tokenizer.token_to_text(prompt_ids[i])
        assert len(entry) in (2, 3)
    chat = httpx.post(f"{served[0].url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200
    chat_scores = chat.json()["prompt_logprobs"]
    assert chat_scores[0] is None and all(len(entry) == 1 for entry in chat_scores[1:])


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, "max_tokens"),
], ids=["max-tokens-0-without-echo", "negative-max-tokens", "min-tokens-above-0", "prompt-logprobs-21",
        "prompt-logprobs-streamed", "echo-not-a-bool", "chat-max-tokens-0"])
def test_bad_combinations_are_400s_in_openais_shape(served, model, path, body, param):
    response = httpx.post(f"{served[0].url}{path}", json={"model": model, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


# -- engine parts ------------------------------------------------------------------------------
def scheduled(seq_id: str, prompt: list[int], start: int, count: int, **params) -> ScheduledSequence:
    seq = Sequence(seq_id, seq_id, 0, prompt, SamplingParams(**params), max_tokens=4, arrival_time=0.0)
    return ScheduledSequence(seq, prompt[start:start + count], start, [0, 1], samples=start + count == len(prompt))


def test_steps_list_rows_to_score_only_for_prompt_tokens_of_requests_that_ask():
    batch = InputBatch(block_size=16, device="cpu")
    prompt = list(range(10, 30))
    assert batch.prepare([scheduled("plain", prompt, 0, 8)]).prompt_logprobs is None
    step = batch.prepare([scheduled("plain", prompt, 8, 12), scheduled("scored", prompt, 0, 8, prompt_logprobs=1)])
    # flat rows: "plain" (12 rows) then "scored" (8): each scored row predicts the next prompt token
    assert step.prompt_logprobs.rows.tolist() == list(range(12, 20))
    assert step.prompt_logprobs.targets.tolist() == prompt[1:9]
    last = batch.prepare([scheduled("scored", prompt, 8, 12, prompt_logprobs=1)]).prompt_logprobs
    assert last.rows.tolist() == list(range(11)) and last.targets.tolist() == prompt[9:]  # not the last token
    assert batch.prepare([scheduled("scored", prompt + [5], 20, 1, prompt_logprobs=1)]).prompt_logprobs is None


class Letters:
    """A tokenizer stand-in for the output processor: token i is one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_a_rescored_prompt_keeps_its_first_scores():
    processor = OutputProcessor(Letters())
    processor.add_request("r", [1, 2, 3, 4], SamplingParams(prompt_logprobs=0), "default", RequestMetrics())
    processor.add_prompt_logprobs({"r": (1, [TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)])})
    processor.add_prompt_logprobs({"r": (1, [TokenLogprob(2, -9.0), TokenLogprob(3, -9.0), TokenLogprob(4, -3.0)])})
    scores = processor.abort("r").prompt_logprobs
    assert [None if s is None else s.logprob for s in scores] == [None, -1.0, -2.0, -3.0]


def test_a_completion_ahead_of_the_prompt_scores_waits_and_arrives_with_them():
    """Completion 1 of 2 samples before completion 0 finished scoring the prompt (after a preemption):
    its token is held, and the request's first snapshot carries it with the complete prompt logprobs."""
    processor = OutputProcessor(Letters())
    params = SamplingParams(n=2, prompt_logprobs=0, max_tokens=4)
    processor.add_request("r", [1, 2, 3], params, "default", RequestMetrics())
    seqs = [Sequence(f"r#{i}", "r", i, [1, 2, 3], SamplingParams(prompt_logprobs=0), 4, 0.0,
                     status=SequenceStatus.RUNNING) for i in range(2)]
    seqs[1].append_output_token(5)
    assert processor.process([SequenceUpdate(seqs[1], [5])]) == ([], [])
    processor.add_prompt_logprobs({"r": (1, [TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)])})
    seqs[0].append_output_token(6)
    seqs[1].append_output_token(7)
    (output,), _ = processor.process([SequenceUpdate(seqs[0], [6]), SequenceUpdate(seqs[1], [7])])
    assert [None if s is None else s.token_id for s in output.prompt_logprobs] == [None, 2, 3]
    assert [(c.token_ids_delta, c.text_delta) for c in output.outputs] == [([6], "g"), ([5, 7], "fh")]
