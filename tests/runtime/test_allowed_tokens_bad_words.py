"""vLLM's `allowed_token_ids` and `bad_words`: the sampler, the persistent batch, the engine and the real server.

The sampler tests check the masks against hand computations (only allowed ids are drawn, one-token
words are always banned and a longer word's last token only after its prefix, the order with the
min_tokens mask and logit_bias, logprobs from the raw logits); the tokenizer test checks vLLM's rule
for a word's spaced form on SmolLM2's tokenizer. The engine test gives token ids (no server) to the
tiny random Llama with async scheduling off and on and requires the same tokens, and that a request
with allowed ids alone still runs ahead. The server tests start SmolLM2-135M-Instruct on CPU once
for the module and send the options through the official `openai` client's `extra_body`: greedy
output under allowed_token_ids equals the argmax over those ids of our model's own logits (computed
without the engine), sampled and streamed tokens stay in the set, a prompt whose greedy answer holds
" Paris" (one token) or "Eiffel" (two) no longer does with it as a bad word, a neighbour in the same
batch gets its tokens alone, and bad values are 400s naming the param, before any stream starts.
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
from sits.runtime.engine.request import SamplingParams, SamplingParamsError
from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.scheduler_output import ScheduledSequence
from sits.runtime.engine.token_masks import StepTokenMask, bad_words_token_ids
from sits.runtime.server.runner import BackgroundServer
from tests.runtime.engine_helpers import generate_all
from tests.runtime.sampling_helpers import EOS, VOCAB, fixed_logits, seq
from tests.support.model_driver import greedy_generate
from tests.support.serving import beside_a_stream, serve_loaded

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the sampler ---------------------------------------------------------------------------------
def test_greedy_takes_the_best_allowed_token_and_other_rows_stay_exact():
    sampler = Sampler([EOS])
    logits = fixed_logits(3, seed=1)
    order = logits.argsort(dim=-1, descending=True).tolist()
    allowed = order[0][3:6]  # not the row's three best tokens
    rows = [seq("allowed", temperature=0.0, allowed_token_ids=allowed),
            seq("one", temperature=0.0, allowed_token_ids=[order[1][-1]]),
            seq("plain", temperature=0.0)]
    assert [t.token_id for t in sampler(logits, rows)] == [order[0][3], order[1][-1], order[2][0]]


def test_sampling_draws_allowed_tokens_only_and_logprobs_stay_raw():
    sampler = Sampler([EOS], seed=2)
    logits = torch.zeros(1, VOCAB)  # uniform without the mask
    drawn = {sampler(logits, [seq(temperature=1.0, allowed_token_ids=[3, 5, 8])])[0].token_id for _ in range(100)}
    assert drawn == {3, 5, 8}
    logits = fixed_logits(1, seed=4)
    weakest = int(logits[0].argmin())
    token = sampler(logits, [seq(temperature=0.0, logprobs=2, allowed_token_ids=[weakest])])[0]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert token.token_id == weakest  # logprobs of the raw logits, as vLLM's default: not 0
    assert token.logprob.logprob == pytest.approx(float(raw[weakest]), abs=1e-5)
    assert [t for t, _ in token.logprob.top] == raw.topk(2).indices.tolist()


def test_a_one_token_bad_word_is_always_banned_and_a_longer_one_after_its_prefix():
    sampler = Sampler([EOS])
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0, 8.0, 7.0] + [-5.0] * (VOCAB - 7)])
    words = [[4], [1, 2, 5]]  # "4" always; "5" only right after 1, 2
    assert sampler(logits, [seq(temperature=0.0, bad_words_token_ids=words)])[0].token_id == 5
    after_prefix = seq(output=(3, 1, 2), temperature=0.0, bad_words_token_ids=words)
    assert sampler(logits, [after_prefix])[0].token_id == 6
    broken_prefix = seq(output=(1, 3, 2), temperature=0.0, bad_words_token_ids=words)
    assert sampler(logits, [broken_prefix])[0].token_id == 5
    # The prompt is not part of the match (vLLM matches output tokens only).
    in_prompt = seq(prompt=(7, 1), output=(2,), temperature=0.0, bad_words_token_ids=words)
    assert sampler(logits, [in_prompt])[0].token_id == 5


def test_masks_come_before_the_min_tokens_mask_and_logit_bias():
    sampler = Sampler([EOS])
    logits = torch.tensor([[9.0, 1.0, 2.0] + [-10.0] * (VOCAB - 3)])
    # EOS (0) allowed but masked below min_tokens; +100 cannot bring back a token outside the set.
    early = seq(temperature=0.0, min_tokens=2, allowed_token_ids=[EOS, 1, 2], logit_bias={7: 100.0})
    assert sampler(logits, [early])[0].token_id == 2
    banned = seq(temperature=0.0, bad_words_token_ids=[[0]], logit_bias={0: 100.0, 1: 1.5})
    assert sampler(logits, [banned])[0].token_id == 1  # 1 + 1.5 > 2


def test_the_step_mask_is_only_built_for_rows_that_ask():
    rows = [seq("p", temperature=0.0), seq("a", temperature=0.0, allowed_token_ids=[3, 4]),
            seq("b", output=(6,), temperature=0.0, bad_words_token_ids=[[6, 9], [2]])]
    mask = StepTokenMask.of_sequences(rows, "cpu")
    assert mask.allowed_rows.tolist() == [1]
    assert list(zip(mask.kept_rows.tolist(), mask.kept_ids.tolist(), strict=True)) == [(1, 3), (1, 4)]
    assert sorted(zip(mask.banned_rows.tolist(), mask.banned_ids.tolist(), strict=True)) == [(2, 2), (2, 9)]
    assert StepTokenMask.of_sequences([rows[0]], "cpu") is None
    assert StepTokenMask.of_sequences([seq(bad_words_token_ids=[[6, 9]])], "cpu") is None  # nothing banned yet
    # The per-step path hands the masks over (the persistent batch keeps them per row) ...
    sampler = Sampler([EOS])
    logits = torch.zeros(3, VOCAB)
    logits[:, 9], logits[:, 2], logits[:, 4] = 3.0, 2.0, 1.0
    assert sampler.sample(logits, rows, token_mask=mask).token_ids.tolist() == [9, 4, 4]
    # ... and without them the fast path is the plain argmax.
    assert sampler.sample(logits, rows).token_ids.tolist() == [9, 9, 9]


def test_sampling_params_validate_both_options():
    SamplingParams(allowed_token_ids=[0, VOCAB - 1], bad_words=["a", " b c"], bad_words_token_ids=[[1], [2, 3]]
                   ).validate(vocab_size=VOCAB)
    SamplingParams(bad_words=[]).validate()  # empty: off, as in vLLM
    bad = [(dict(allowed_token_ids=[]), "allowed_token_ids", "non-empty"),
           (dict(allowed_token_ids=[VOCAB]), "allowed_token_ids", "out of range"),
           (dict(allowed_token_ids=[-1]), "allowed_token_ids", "non-negative"),
           (dict(allowed_token_ids=[True]), "allowed_token_ids", "non-negative"),
           (dict(bad_words=[""]), "bad_words", "non-empty"), (dict(bad_words=["  "]), "bad_words", "non-empty"),
           (dict(bad_words=[3]), "bad_words", "non-empty"), (dict(bad_words=["w"] * 129), "bad_words", "at most 128"),
           (dict(bad_words_token_ids=[[]]), "bad_words", "non-empty"),
           (dict(bad_words_token_ids=[[1, VOCAB]]), "bad_words", "out of range")]
    for params, param, message in bad:
        with pytest.raises(SamplingParamsError, match=message) as error:
            SamplingParams(**params).validate(vocab_size=VOCAB)
        assert error.value.param == param


def test_bad_words_are_tokenized_as_vllm_does(smollm2):
    tokenizer = smollm2.tokenizer

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # As written and with a leading space (leading whitespace of the word itself is dropped first).
    assert bad_words_token_ids(["Paris", "  Eiffel"], tokenizer) == [ids("Paris"), ids(" Paris"), ids("Eiffel"),
                                                                       ids(" Eiffel")]
    assert len(ids("Eiffel")) == 2
    # A spaced form with another number of tokens is left out, by vLLM's rule.
    assert len(ids("Tokyo")) != len(ids(" Tokyo"))
    assert bad_words_token_ids(["Tokyo"], tokenizer) == [ids("Tokyo")]


# -- the persistent batch ------------------------------------------------------------------------
def test_the_input_batch_gathers_masks_of_the_rows_it_samples_only():
    batch = InputBatch(4, "cpu", rows=2)
    plain = seq("plain", prompt=range(5))
    masked = seq("masked", prompt=range(6), allowed_token_ids=[2, 9], bad_words_token_ids=[[7]])
    step = batch.prepare([ScheduledSequence(plain, list(range(5)), 0, [0, 1], samples=True),
                          ScheduledSequence(masked, list(range(4)), 0, [2], samples=False)])
    assert step.token_mask is None  # a prefill chunk short of the prompt's end samples nothing
    step = batch.prepare([ScheduledSequence(plain, [7], 5, [0, 1], samples=True),
                          ScheduledSequence(masked, [4, 5], 4, [2, 3], samples=True)])
    assert [s.seq_id for s in step.sample_sequences] == ["masked", "plain"]
    assert step.token_mask.allowed_rows.tolist() == [0] and step.token_mask.kept_ids.tolist() == [2, 9]
    assert step.token_mask.banned_rows.tolist() == [0] and step.token_mask.banned_ids.tolist() == [7]
    batch.release([masked])
    step = batch.prepare([ScheduledSequence(plain, [8], 6, [0, 1], samples=True)])
    assert step.token_mask is None and batch.num_rows_in_use == 1


# -- the engine, token ids only, async scheduling off and on -------------------------------------


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_engine_takes_token_ids_and_async_scheduling_gives_the_same_tokens(tiny):
    prompt = tiny.tokenizer.encode("The three primary colors are")
    plain = {"plain": (prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))}
    plain_tokens = generate_all(tiny, False, plain)[0]["plain"][0]
    allowed = sorted(set(plain_tokens[1::2]) | {11, 222, 3333})  # leaves the plain answer's first token out
    pair = plain_tokens[2:4]  # a two-token "word" of the plain answer
    requests = {
        **plain,
        "allowed": (prompt, SamplingParams(temperature=0.0, max_tokens=10, allowed_token_ids=allowed)),
        "allowed-n2": (prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=allowed)),
        "banned": (prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                          bad_words_token_ids=[plain_tokens[:1], pair])),
    }
    sync, _ = generate_all(tiny, False, requests)
    overlapped, async_engine = generate_all(tiny, True, requests)
    assert overlapped == sync
    assert sync["plain"] == [plain_tokens]
    assert all(set(tokens) <= set(allowed) for tokens in sync["allowed"] + sync["allowed-n2"])
    assert sync["allowed"] != [plain_tokens[:10]]
    banned = sync["banned"][0]
    assert plain_tokens[0] not in banned and not contains(banned, pair) and len(banned) == 12
    # Allowed ids never change, so a request with them alone still lets the engine run a step ahead.
    only_allowed = {"allowed": requests["allowed"]}
    overlapped, async_engine = generate_all(tiny, True, only_allowed)
    assert async_engine.runner.pending_inputs > 0 and overlapped["allowed"] == sync["allowed"]
    # A bad word of several tokens needs the previous token: no step ahead while it runs.
    overlapped, async_engine = generate_all(tiny, True, {"banned": requests["banned"]})
    assert async_engine.runner.pending_inputs == 0 and overlapped["banned"] == sync["banned"]


# -- the server ----------------------------------------------------------------------------------
PARIS = "The capital of France is"  # greedy: " Paris. ..."
LANDMARK = "The most famous landmark in Paris is the"  # greedy: " Eiffel Tower. ..."
QUESTION = [{"role": "user", "content": "Q: What is the capital of France?\nA:"}]
WORDS = [" blue", " red", " green", " the", " and", " sky", " is", ".", ","]


@pytest.fixture(scope="module")
def served(smollm2) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    with serve_loaded(smollm2, max_model_len=512, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=256) as served:
        yield served


@pytest.fixture(scope="module")
def allowed(served) -> dict[int, str]:
    """The allowed ids of the server tests (one token each, distinct texts) -> their texts."""
    tokenizer = served[1].tokenizer
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in WORDS]
    assert all(len(i) == 1 for i in ids), ids
    return {i[0]: tokenizer.token_to_text(i[0]) for i in ids}


def restricted_greedy(served, smollm2, body: dict, allowed: dict[int, str], max_tokens: int) -> list[int]:
    """The reference: greedy over the allowed ids of our model's logits, run without the engine, from
    the prompt ids the server renders for `body` (its /tokenize)."""
    response = httpx.post(f"{served[0].url}/tokenize", json={"model": served[1].model_name, **body}, timeout=60)
    others = frozenset(range(smollm2.config.vocab_size)) - set(allowed)
    return greedy_generate(smollm2.model, [response.json()["tokens"]], max_tokens, suppress_ids=others)[0]


def test_greedy_under_allowed_ids_is_the_argmax_over_them_of_the_model_logits(client, model, served, smollm2, allowed):
    completion = client.completions.create(model=model, prompt=PARIS, max_tokens=8, temperature=0, logprobs=0,
                                           extra_body={"allowed_token_ids": list(allowed)})
    choice = completion.choices[0]
    reference = restricted_greedy(served, smollm2, {"prompt": PARIS}, allowed, 8)
    assert choice.logprobs.tokens == [allowed[t] for t in reference]
    assert choice.text == "".join(allowed[t] for t in reference) and choice.finish_reason == "length"
    # Logprobs are those of the raw logits: the mask does not make them ~0.
    assert min(choice.logprobs.token_logprobs) < -1.0
    plain = client.completions.create(model=model, prompt=PARIS, max_tokens=8, temperature=0).choices[0].text
    assert plain.startswith(" Paris")  # the restriction changed the answer
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                                          extra_body={"allowed_token_ids": list(allowed)})
    reference = restricted_greedy(served, smollm2, {"messages": QUESTION}, allowed, 6)
    assert [entry.token for entry in chat.choices[0].logprobs.content] == [allowed[t] for t in reference]


def test_sampled_and_streamed_tokens_stay_in_the_allowed_ids(client, model, allowed):
    texts = set(allowed.values())
    sampled = client.completions.create(model=model, prompt=PARIS, max_tokens=8, n=2, temperature=1.2, seed=4,
                                        logprobs=0, extra_body={"allowed_token_ids": list(allowed)})
    assert len(sampled.choices) == 2
    assert all(set(c.logprobs.tokens) <= texts and len(c.logprobs.tokens) == 8 for c in sampled.choices)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, n=2, temperature=1.0,
                                                 seed=7, stream=True, logprobs=True,
                                                 extra_body={"allowed_token_ids": list(allowed)}))
    tokens: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            tokens[choice.index] += [entry.token for entry in (choice.logprobs.content if choice.logprobs else [])]
    assert all(len(t) == 6 and set(t) <= texts for t in tokens.values()), tokens


def test_a_one_token_bad_word_never_appears(client, model):
    plain = client.completions.create(model=model, prompt=PARIS, max_tokens=8, temperature=0).choices[0].text
    assert plain.startswith(" Paris")
    banned = client.completions.create(model=model, prompt=PARIS, max_tokens=8, temperature=0,
                                       extra_body={"bad_words": ["Paris"]}).choices[0]
    assert "Paris" not in banned.text and banned.text and banned.finish_reason == "length"
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                          extra_body={"bad_words": [" Paris"]})  # the leading space is dropped
    assert "Paris" not in chat.choices[0].message.content and chat.choices[0].message.content


def test_a_two_token_bad_word_never_appears_streamed_or_sampled(client, model):
    plain = client.completions.create(model=model, prompt=LANDMARK, max_tokens=6, temperature=0).choices[0].text
    assert plain.startswith(" Eiffel Tower")
    chunks = list(client.completions.create(model=model, prompt=LANDMARK, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"bad_words": ["Eiffel", "Tower"]}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text and "Eiffel" not in text and "Tower" not in text
    assert chunks[-1].usage.completion_tokens == 6
    sampled = client.completions.create(model=model, prompt=LANDMARK, max_tokens=6, n=2, temperature=0.3, seed=1,
                                        extra_body={"bad_words": ["Eiffel"], "repetition_penalty": 1.1})
    assert all(c.text and "Eiffel" not in c.text for c in sampled.choices)


def test_a_neighbour_without_the_options_gets_its_tokens_alone(client, model, allowed):
    alone = client.completions.create(model=model, prompt=PARIS, max_tokens=8, temperature=0).choices[0].text
    together, masked_text = beside_a_stream(
        lambda: client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                          stream=True, extra_body={"allowed_token_ids": list(allowed),
                                                                   "bad_words": ["the sky"]}),
        lambda: client.completions.create(model=model, prompt=PARIS, max_tokens=8, temperature=0))
    assert together.choices[0].text == alone
    assert masked_text and "the sky" not in masked_text


@pytest.mark.parametrize(("extra", "param"), [
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"), ({"allowed_token_ids": ["12"]}, "allowed_token_ids"),
    ({"allowed_token_ids": 12}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"), ({"bad_words": "Paris"}, "bad_words"), ({"bad_words": ["   "]}, "bad_words"),
], ids=["empty", "vocab-size", "negative", "string-id", "not-a-list", "empty-word", "number-word", "not-a-list-word",
        "blank-word"])
def test_bad_values_are_400s_naming_the_param(served, model, extra, param):
    server, _ = served
    for (path, body), stream in itertools.product(
            (("/v1/completions", {"prompt": PARIS}), ("/v1/chat/completions", {"messages": QUESTION})), (False, True)):
        # A stream too: refused before it starts, never a 200 followed by an error event.
        response = httpx.post(f"{server.url}{path}", json={"model": model, "max_tokens": 2, **body, "stream": stream,
                                                          **extra}, timeout=60)
        assert response.status_code == 400, (path, stream, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_official_client_sees_the_400_and_the_server_keeps_serving(client, model, served):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, stream=True,
                                       extra_body={"allowed_token_ids": [10**6]})
    assert error.value.param == "allowed_token_ids"
    assert client.completions.create(model=model, prompt=PARIS, max_tokens=2, temperature=0,
                                     extra_body={"bad_words": []}).choices[0].text
    assert httpx.get(f"{served[0].url}/health", timeout=10).status_code == 200
