"""The sampler: each parameter's effect, seeds, penalties against a hand computation, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.sequence import Sequence
from tests.runtime.sampling_helpers import EOS, VOCAB, fixed_logits, seq


def draw(sampler: Sampler, logits: torch.Tensor, sequence: Sequence, times: int) -> Counter:
    return Counter(sampler(logits, [sequence])[0].token_id for _ in range(times))


def test_greedy_is_exactly_argmax_of_float32_logits():
    sampler = Sampler([EOS])
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3))
    logits[2, 17] = logits[2].max() + 1e-6  # a near-tie still resolves to the true argmax
    tokens = [t.token_id for t in sampler(logits, [seq(f"s{i}", temperature=0.0) for i in range(5)])]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_temperature_sharpens_and_flattens_the_distribution():
    sampler = Sampler([EOS], seed=1)
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (VOCAB - 3)])
    cold = draw(sampler, logits, seq(temperature=0.05), 200)
    assert cold[0] == 200
    hot = draw(sampler, logits, seq(temperature=2.0), 600)
    assert set(hot) == {0, 1, 2}
    # At T=2 the probabilities are softmax([1, .5, 0]) = .51, .31, .19.
    assert 0.40 < hot[0] / 600 < 0.62 and 0.10 < hot[2] / 600 < 0.28


def test_samples_follow_the_softmax_distribution():
    sampler = Sampler([EOS], seed=5)
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)] + [-1e9] * (VOCAB - 3)])
    counts = draw(sampler, logits, seq(temperature=1.0), 2000)
    for token, p in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[token] / 2000 - p) < 0.04


def test_top_k_keeps_only_the_k_best_tokens():
    sampler = Sampler([EOS], seed=2)
    logits = fixed_logits()
    best3 = set(logits[0].topk(3).indices.tolist())
    counts = draw(sampler, logits, seq(temperature=1.5, top_k=3), 300)
    assert set(counts) == best3
    assert set(draw(sampler, logits, seq(temperature=1.5, top_k=1), 20)) == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_set_reaching_p():
    sampler = Sampler([EOS], seed=2)
    probs = torch.tensor([0.45, 0.25, 0.15, 0.1] + [0.05 / (VOCAB - 4)] * (VOCAB - 4))
    logits = probs.log().unsqueeze(0)
    # 0.45 + 0.25 = 0.70 < 0.75, so the third token is needed to reach p = 0.75, the fourth is not.
    counts = draw(sampler, logits, seq(temperature=1.0, top_p=0.75), 400)
    assert set(counts) == {0, 1, 2}
    assert set(draw(sampler, logits, seq(temperature=1.0, top_p=0.3), 50)) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    sampler = Sampler([EOS], seed=4)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05] + [1e-6] * (VOCAB - 5))
    logits = (probs / probs.sum()).log().unsqueeze(0)
    # min_p 0.3: threshold 0.12 keeps tokens 0, 1, 2.
    assert set(draw(sampler, logits, seq(temperature=1.0, min_p=0.3), 400)) == {0, 1, 2}


def test_same_seed_gives_the_same_tokens_whatever_else_is_batched():
    logits = fixed_logits(rows=4, seed=9)

    def run(batch_ids, seeds, steps=20):
        sampler = Sampler([EOS], seed=123)
        sequences = [seq(f"s{i}", temperature=1.0, seed=seeds[i]) for i in batch_ids]
        out = []
        for _ in range(steps):
            sampled = sampler(logits[batch_ids], sequences)
            out.append(sampled[batch_ids.index(0)].token_id)
        return out

    seeds = {0: 42, 1: 7, 2: None, 3: 42}
    alone = run([0], seeds)
    assert alone == run([2, 0, 1], seeds) == run([0, 3], seeds)
    assert len(set(alone)) > 1  # it really sampled
    assert alone != run([0], {0: 43})


def test_unseeded_requests_draw_from_the_engine_generator():
    logits = fixed_logits(seed=1)

    def tokens(engine_seed: int) -> list[int]:
        sampler = Sampler([EOS], seed=engine_seed)
        return [sampler(logits, [seq(temperature=1.0)])[0].token_id for _ in range(30)]

    assert tokens(11) == tokens(11)  # reproducible for a fixed engine seed
    assert tokens(11) != tokens(12)


def test_penalties_match_a_hand_computation():
    sampler = Sampler([EOS])
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0] + [-5.0] * (VOCAB - 6)])
    s = seq(prompt=(1, 2), output=(2, 3, 3), temperature=0.0,
            repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3)
    expected = logits.clone()[0]
    for token in (1, 2, 3):  # seen in prompt or output: divide positives, multiply negatives
        expected[token] = expected[token] / 1.5 if expected[token] > 0 else expected[token] * 1.5
    counts = {2: 1, 3: 2}
    for token, count in counts.items():
        expected[token] -= 0.3 * count + 0.4
    # 3.0 -> 2.0 -> 2.0 - 0.6 - 0.4 = 1.0; token 0 (2.0) is now the argmax.
    assert sampler(logits, [s])[0].token_id == int(expected.argmax()) == 0

    from sits.runtime.engine.sampling_ops import apply_penalties, token_counts

    got = apply_penalties(
        logits.clone(), token_counts([[1, 2]], VOCAB, logits.device), token_counts([[2, 3, 3]], VOCAB, logits.device),
        torch.tensor([1.5]), torch.tensor([0.4]), torch.tensor([0.3]),
    )
    torch.testing.assert_close(got[0], expected)


def test_min_tokens_masks_eos_and_stop_token_ids():
    sampler = Sampler([EOS])
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 3] = 8.0
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    assert sampler(logits, [seq(output=(7,), **params)])[0].token_id == 3
    assert sampler(logits, [seq(output=(7, 7), **params)])[0].token_id == EOS  # min_tokens reached
    assert sampler(logits, [seq(output=(7,), temperature=0.0, min_tokens=2, ignore_eos=True)])[0].token_id == EOS


def test_logprobs_are_log_softmax_of_the_raw_logits_with_top_alternatives():
    sampler = Sampler([EOS], seed=0)
    logits = fixed_logits(rows=2, seed=6)
    sampled = sampler(logits, [seq("a", temperature=0.0, logprobs=3), seq("b", temperature=0.7, logprobs=0)])
    expected = torch.log_softmax(logits, dim=-1)
    a, b = sampled
    assert a.logprob.token_id == a.token_id
    assert a.logprob.logprob == pytest.approx(float(expected[0, a.token_id]), abs=1e-6)
    top_ids = expected[0].topk(3).indices.tolist()
    assert [t for t, _ in a.logprob.top] == top_ids
    assert [lp for _, lp in a.logprob.top] == pytest.approx(expected[0, top_ids].tolist(), abs=1e-6)
    assert b.logprob.top == [] and b.logprob.logprob == pytest.approx(float(expected[1, b.token_id]), abs=1e-6)
    assert sampler(logits[:1], [seq(temperature=0.0)])[0].logprob is None  # not asked for


def test_a_seeded_sequence_owns_its_generator_and_a_new_sequence_starts_from_the_seed():
    sampler = Sampler([EOS])
    logits = fixed_logits()
    sequence = seq("gone", temperature=1.0, seed=3)
    first = sampler(logits, [sequence])[0].token_id
    assert isinstance(sequence.generator, torch.Generator)  # on the sequence: it goes with it
    again = seq("gone", temperature=1.0, seed=3)  # the same id and seed, a new sequence
    assert sampler(logits, [again])[0].token_id == first  # a fresh generator from the same seed


def test_greedy_argmax_falls_back_to_torch_where_the_kernel_cannot_be_built(monkeypatch, caplog):
    import sits.kernels.argmax as argmax_kernels
    from sits.runtime.engine import sampler as sampler_module

    def broken(device):
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(argmax_kernels, "warm_up", broken)
    with caplog.at_level("WARNING", logger=sampler_module.__name__):
        argmax = sampler_module._argmax_on(torch.device("cuda"))
    assert argmax is sampler_module._torch_argmax
    assert "torch.argmax" in caplog.text and "no compiler for this GPU" in caplog.text
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0], [float("nan"), 1.0, 2.0, 0.0]])
    assert argmax(logits).tolist() == [1, 0]
