"""OpenAI's `logit_bias`: the sampler, the persistent batch, async scheduling and the real server.

The sampler tests check the bias against hand computations (its order with the min_tokens mask and
the penalties, logprobs from the raw logits). The engine test runs biased and unbiased requests
through the tiny random Llama with async scheduling off and on and requires the same tokens. The
server tests start SmolLM2-135M-Instruct on CPU once for the module and talk to it with the official
`openai` client: +100 forces a token, -100 bans one, with n=2, penalties and streaming; a request
without logit_bias batched with a biased one gets exactly its tokens alone; and bad maps are 400s
naming `logit_bias` that leave the server serving.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.input_batch import InputBatch
from sits.runtime.engine.logit_bias import StepLogitBias
from sits.runtime.engine.request import SamplingParams, SamplingParamsError
from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.scheduler_output import ScheduledSequence
from sits.runtime.server.runner import BackgroundServer
from tests.runtime.engine_helpers import generate_all
from tests.runtime.sampling_helpers import EOS, VOCAB, fixed_logits, seq
from tests.support.serving import beside_a_stream, serve_loaded


# -- the sampler ---------------------------------------------------------------------------------
def test_greedy_follows_the_biased_logits_and_unbiased_rows_stay_exact():
    sampler = Sampler([EOS])
    logits = fixed_logits(3)
    top = logits.argmax(dim=-1).tolist()
    weakest = int(logits[0].argmin())
    second = int(logits[1].topk(2).indices[1])
    rows = [seq("forced", temperature=0.0, logit_bias={weakest: 100.0}),
            seq("banned", temperature=0.0, logit_bias={top[1]: -100.0}),
            seq("plain", temperature=0.0)]
    tokens = [t.token_id for t in sampler(logits, rows)]
    assert tokens == [weakest, second, top[2]]
    # A small bias shifts the argmax only when it closes the gap.
    gap = float(logits[1, top[1]] - logits[1, second])
    nudged = [seq("a", temperature=0.0, logit_bias={second: gap + 0.01}),
              seq("b", temperature=0.0, logit_bias={second: gap - 0.01})]
    assert [t.token_id for t in sampler(logits[[1, 1]], nudged)] == [second, top[1]]


def test_sampling_never_draws_a_banned_token_and_always_a_forced_one():
    sampler = Sampler([EOS], seed=3)
    logits = torch.zeros(1, VOCAB)  # uniform without the bias
    banned = {token: -100.0 for token in range(VOCAB) if token % 2}
    drawn = {sampler(logits, [seq(temperature=1.0, logit_bias=banned)])[0].token_id for _ in range(200)}
    assert drawn and all(token % 2 == 0 for token in drawn)
    forced = {sampler(logits, [seq(temperature=1.5, top_p=0.9, seed=i, logit_bias={7: 100.0})])[0].token_id
              for i in range(50)}
    assert forced == {7}


def test_bias_comes_after_the_min_tokens_mask_and_before_the_penalties():
    sampler = Sampler([EOS])
    logits = torch.tensor([[5.0, 1.0, 2.0] + [-10.0] * (VOCAB - 3)])
    # EOS is masked below min_tokens: +100 cannot bring it back.
    early = seq(temperature=0.0, min_tokens=3, logit_bias={EOS: 100.0})
    assert sampler(logits, [early])[0].token_id == 2
    # Repetition penalty acts on the biased logit: token 1 seen, (1 + 6) / 2 = 3.5 > 2 (token 2); EOS off.
    penalised = seq(prompt=(7, 8), output=(1,), temperature=0.0, min_tokens=5, repetition_penalty=2.0, logit_bias={1: 6.0})
    assert sampler(logits, [penalised])[0].token_id == 1
    penalised = seq(prompt=(7, 8), output=(1,), temperature=0.0, min_tokens=5, repetition_penalty=2.0, logit_bias={1: 2.0})
    assert sampler(logits, [penalised])[0].token_id == 2  # (1 + 2) / 2 = 1.5 < 2
    # Frequency penalty subtracts from the biased logit: 1 + 4 - 2 * 1 = 3 > 2.
    penalised = seq(prompt=(7, 8), output=(1,), temperature=0.0, min_tokens=5, frequency_penalty=2.0, logit_bias={1: 4.0})
    assert sampler(logits, [penalised])[0].token_id == 1


def test_logprobs_are_those_of_the_raw_logits():
    sampler = Sampler([EOS])
    logits = fixed_logits(1, seed=4)
    weakest = int(logits[0].argmin())
    token = sampler(logits, [seq(temperature=0.0, logprobs=2, logit_bias={weakest: 100.0})])[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert token.token_id == weakest
    assert token.logprob.logprob == pytest.approx(float(raw[weakest]), abs=1e-5)
    assert [t for t, _ in token.logprob.top] == raw.topk(2).indices.tolist()


def test_sample_takes_the_step_biases_it_is_given():
    sampler = Sampler([EOS])
    logits = fixed_logits(2, seed=5)
    rows = [seq("p", temperature=0.0), seq("b", temperature=0.0, logit_bias={3: 100.0})]
    # The per-step path hands the biases over (the persistent batch keeps them per row) ...
    step_bias = StepLogitBias.of_sequences(rows, "cpu")
    assert step_bias is not None and step_bias.rows.tolist() == [1]
    assert sampler.sample(logits, rows, step_bias).token_ids.tolist() == [int(logits[0].argmax()), 3]
    # ... and without them the fast path is the plain argmax.
    assert sampler.sample(logits, rows).token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert StepLogitBias.of_sequences([rows[0]], "cpu") is None


def test_sampling_params_validate_the_map():
    SamplingParams(logit_bias={0: -100.0, 5: 100, 11: 0.5}).validate(vocab_size=VOCAB)
    SamplingParams(logit_bias={i: 1.0 for i in range(300)}).validate()
    bad = [({i: 1.0 for i in range(301)}, "at most 300"), ({1: 100.5}, "between -100 and 100"),
           ({1: -101.0}, "between -100 and 100"), ({1: float("nan")}, "between"), ({-1: 1.0}, "non-negative"),
           ({VOCAB: 1.0}, "out of range")]
    for logit_bias, message in bad:
        with pytest.raises(SamplingParamsError, match=message) as error:
            SamplingParams(logit_bias=logit_bias).validate(vocab_size=VOCAB)
        assert error.value.param == "logit_bias"


# -- the persistent batch ------------------------------------------------------------------------
def test_the_input_batch_gathers_biases_of_the_biased_rows_it_samples_only():
    batch = InputBatch(4, "cpu", rows=2)
    plain, biased = seq("plain", prompt=range(5)), seq("biased", prompt=range(6), logit_bias={2: 5.0, 9: -3.0})
    step = batch.prepare([ScheduledSequence(plain, list(range(5)), 0, [0, 1], samples=True)])
    assert step.logit_bias is None
    # A prefill chunk that stops short of the prompt's end samples nothing: no bias.
    step = batch.prepare([ScheduledSequence(plain, [7], 5, [0, 1], samples=True),
                          ScheduledSequence(biased, list(range(4)), 0, [2], samples=False)])
    assert step.logit_bias is None
    # The rest of the prompt comes first (prefill path), the plain decode second.
    step = batch.prepare([ScheduledSequence(plain, [8], 6, [0, 1], samples=True),
                          ScheduledSequence(biased, [4, 5], 4, [2, 3], samples=True)])
    assert [s.seq_id for s in step.sample_sequences] == ["biased", "plain"]
    assert step.logit_bias.rows.tolist() == [0, 0]
    assert step.logit_bias.token_ids.tolist() == [2, 9] and step.logit_bias.values.tolist() == [5.0, -3.0]
    step = batch.prepare([ScheduledSequence(plain, [9], 7, [0, 1], samples=True),
                          ScheduledSequence(biased, [6], 6, [2, 3], samples=True)])
    assert step.logit_bias.rows.tolist() == [1, 1]  # both decode, in the scheduled order
    batch.release([biased])
    step = batch.prepare([ScheduledSequence(plain, [10], 8, [0, 1, 4], samples=True)])
    assert step.logit_bias is None and batch.num_rows_in_use == 1


# -- async scheduling through the engine ---------------------------------------------------------


def test_async_scheduling_gives_the_same_biased_tokens(tiny):
    prompt = tiny.tokenizer.encode("The three primary colors are")
    alone, _ = generate_all(tiny, False, {"plain": (prompt, SamplingParams(temperature=0.0, max_tokens=10))})
    plain_tokens = alone["plain"][0]
    forced, banned = 1234, plain_tokens[0]
    requests = {
        "plain": (prompt, SamplingParams(temperature=0.0, max_tokens=10)),
        "forced": (prompt, SamplingParams(temperature=0.0, max_tokens=8, logit_bias={forced: 100.0})),
        "banned-n2": (prompt, SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True,
                                             logit_bias={t: -100.0 for t in set(plain_tokens)})),
        "penalised": (prompt, SamplingParams(temperature=0.0, max_tokens=8, frequency_penalty=1.5,
                                             logit_bias={banned: -100.0})),
    }
    sync, _ = generate_all(tiny, False, requests)
    overlapped, async_engine = generate_all(tiny, True, requests)
    assert async_engine.runner.pending_inputs > 0  # it really ran ahead
    assert overlapped == sync
    assert sync["plain"] == [plain_tokens]
    assert sync["forced"] == [[forced] * 8]
    assert all(not set(tokens) & set(plain_tokens) for tokens in sync["banned-n2"])
    assert banned not in sync["penalised"][0]


# -- the server ----------------------------------------------------------------------------------
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "Name a primary color."}]


@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    with serve_loaded(smollm2, max_model_len=1024, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256) as served:
        yield served



@pytest.fixture(scope="module")
def token_ids_by_text(served) -> dict[str, list[int]]:
    """Every token's text -> its ids (to read the ids behind the text the API returns)."""
    tokenizer = served[1].tokenizer
    by_text: dict[str, list[int]] = {}
    for token_id in range(tokenizer.vocab_size):
        by_text.setdefault(tokenizer.token_to_text(token_id), []).append(token_id)
    return by_text


def word_token(served, word: str) -> tuple[int, str]:
    """The id and text of a word that is one token."""
    ids = served[1].tokenizer.encode(word, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0], served[1].tokenizer.token_to_text(ids[0])


def test_plus_100_makes_greedy_pick_the_token_every_step(client, model, served):
    token_id, text = word_token(served, " ocean")
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                           logit_bias={str(token_id): 100}, logprobs=1)
    choice = completion.choices[0]
    assert choice.text == text * 6 and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [text] * 6
    # Logprobs are those of the raw logits (vLLM's default): the bias does not make them ~0.
    assert all(lp < -1.0 for lp in choice.logprobs.token_logprobs)
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0,
                                          logit_bias={str(token_id): 100})
    assert chat.choices[0].message.content == text * 5


def test_minus_100_on_the_greedy_token_changes_the_output_and_never_emits_it(client, model, token_ids_by_text):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    (first_id,) = token_ids_by_text[first]
    biased = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                       logit_bias={str(first_id): -100})
    assert biased.choices[0].text != plain.choices[0].text
    assert first not in biased.choices[0].logprobs.tokens
    # With every token of the plain answer banned, none of them appears anywhere.
    banned = {tid for token in plain.choices[0].logprobs.tokens for tid in token_ids_by_text[token]}
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=8, temperature=0, logprobs=True,
                                          logit_bias={str(t): -100 for t in banned})
    emitted = [bytes(entry.bytes).decode("utf-8", "replace") for entry in chat.choices[0].logprobs.content]
    assert emitted and not set(emitted) & set(plain.choices[0].logprobs.tokens)


def test_n2_sampling_and_penalties_honour_the_bias(client, model, served):
    token_id, text = word_token(served, " ocean")
    forced = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=5,
                                       frequency_penalty=1.0, presence_penalty=0.5,
                                       extra_body={"repetition_penalty": 1.2},
                                       logit_bias={str(token_id): 100})
    assert [c.text for c in forced.choices] == [text * 4] * 2
    banned = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, n=2, temperature=1.0,
                                            seed=9, logprobs=True, logit_bias={str(token_id): -100})
    for choice in banned.choices:
        assert choice.logprobs.content and all(e.token != text for e in choice.logprobs.content)


def test_streams_carry_the_biased_tokens(client, model, served):
    token_id, text = word_token(served, " ocean")
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0,
                                                 stream=True, logit_bias={str(token_id): 100}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text * 5
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2, temperature=0.7, seed=1,
                                            stream=True, logit_bias={str(token_id): 100}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: text * 4, 1: text * 4}


def test_a_request_without_bias_batched_with_a_biased_one_gets_its_tokens_alone(client, model, served):
    token_id, text = word_token(served, " ocean")
    alone = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    together, biased_text = beside_a_stream(
        lambda: client.completions.create(model=model, prompt="Once upon a time", max_tokens=48, temperature=0,
                                          stream=True, logit_bias={str(token_id): 100}),
        lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0))
    assert together.choices[0].text == alone
    assert biased_text == text * 48


@pytest.mark.parametrize("logit_bias", [
    {"abc": 1}, {"1.5": 1}, {"12": "high"}, {"-1": 5}, {"49152": 5}, {"99999999999": 5}, {"12": 100.5},
    {"12": -101}, {str(i): 1 for i in range(301)},
], ids=["non-integer-key", "fractional-key", "non-numeric-value", "negative-id", "vocab-size", "huge-id",
        "above-100", "below-minus-100", "301-entries"])
def test_bad_maps_are_400s_naming_logit_bias(served, model, logit_bias):
    server, _ = served
    for (path, body), stream in itertools.product(
            (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": QUESTION})), (False, True)):
        # A stream too: refused before it starts, never a 200 followed by an error event.
        response = httpx.post(f"{server.url}{path}", json={"model": model, "max_tokens": 2, **body, "stream": stream,
                                                          "logit_bias": logit_bias}, timeout=60)
        assert response.status_code == 400, (path, stream, response.text)
        error = response.json()["error"]
        assert error["param"] == "logit_bias" and error["type"] == "invalid_request_error", error


def test_the_server_keeps_serving_after_bad_maps(client, model, served):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, stream=True,
                                       logit_bias={"12": 500})
    assert error.value.param == "logit_bias"
    # The full cap is accepted, and the server answers as before.
    many = {str(i): 0.0 for i in range(300)}
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                     logit_bias=many).choices[0].text
    assert httpx.get(f"{served[0].url}/health", timeout=10).status_code == 200
