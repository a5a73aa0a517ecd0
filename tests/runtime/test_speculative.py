"""N-gram speculative decoding (`--speculative-config`): proposer, scheduler bookkeeping, verification.

The proposer finds the longest suffix (prompt_lookup_max down to prompt_lookup_min) at its latest
earlier occurrence and caps drafts at k and at the room given. The scheduler schedules [token +
drafts], keeps only accepted drafts' KV as computed (only their full blocks get hashed), ends a
sequence at a stop token inside an accepted run and frees everything. The rejection sampler's
first token is distributed exactly as p (checked against p over many fixed-seed draws). On SmolLM2,
greedy output with speculation is token-identical to decoding without it, batched with rows that
cannot speculate (penalties, logit_bias, a stop string), under chunked prefill and preemption, and
the counters prove drafts were accepted; stop token ids and max_tokens end where plain decoding
ends. On the tiny model, sampled tokens follow the same distribution with and without speculation.
The server (official openai client) streams what it returns whole and exports the counters.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import httpx
import openai
import pytest
import torch

from sits.runtime.commands.engine_args import add_engine_arguments, engine_config_from_args
from sits.runtime.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.engine.kv_cache import KVCacheManager
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.scheduler import Scheduler
from sits.runtime.engine.scheduler_output import ModelRunnerOutput, SampledToken
from sits.runtime.engine.sequence import Sequence, SequenceStatus
from sits.runtime.engine.spec_verify import accept_drafts
from sits.runtime.engine.speculative import NgramProposer
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n\ndef")
REPEAT = "Numbers: one two three four five six seven. Again: one two three four five six seven. Again:"
PLAIN = "The capital of France is"


# -- the proposer ------------------------------------------------------------------------------
def test_proposer_takes_the_longest_suffix_at_its_latest_occurrence():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # suffix [2, 3] occurs at 1 (then 9) and at 5 (then 7): the latest wins; [1, 2, 3] does not occur
    assert proposer.propose([5, 2, 3, 9, 0, 2, 3, 7, 8, 2, 3]) == [7, 8, 2]
    # the 3-gram [1, 2, 3] occurs (then 4) and beats the later 1-gram match of [3] (then 6)
    assert proposer.propose([1, 2, 3, 4, 4, 4, 3, 6, 1, 2, 3]) == [4, 4, 4]


def test_proposer_limits_and_misses():
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=4)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2]) == [3, 4]  # k caps
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], max_drafts=1) == [3]  # the room caps
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], max_drafts=0) == []
    assert proposer.propose([1, 2, 3, 4, 5, 6, 2]) == []  # only a 1-gram matches: below prompt_lookup_min
    assert proposer.propose([7, 7]) == []  # too short for a 2-gram with a follower
    assert proposer.propose([1, 2, 9, 1, 2]) == [9, 1]  # continuation runs into the suffix itself
    longest = NgramProposer(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=2)
    # max 2: the 3-gram [1, 2, 3]'s follower 4 is not looked for; the latest 2-gram [2, 3] is
    assert longest.propose([1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3]) == [5, 1, 2, 3]


# -- the scheduler's bookkeeping -----------------------------------------------------------------
def _scheduler(num_blocks: int = 16) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, 64, eos_token_ids=[0],
                     speculative=SPEC)


def _prefilled(scheduler: Scheduler, prompt: list[int], params: SamplingParams, first: int) -> Sequence:
    seq = Sequence("s", "s", 0, prompt, params, max_tokens=params.max_tokens or 32, arrival_time=0.0)
    scheduler.add_request(seq)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(sampled={"s": SampledToken(first)}))
    return seq


def test_scheduler_keeps_only_accepted_drafts():
    scheduler = _scheduler()
    seq = _prefilled(scheduler, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], SamplingParams(temperature=0, max_tokens=20), 3)
    out = scheduler.schedule()  # tokens ...1, 2, 3: the 3-gram [1, 2, 3] then 4 5 6 7
    (scheduled,) = out.scheduled
    assert scheduled.draft_token_ids == [4, 5, 6, 7]
    assert scheduled.token_ids == [3, 4, 5, 6, 7] and out.num_batched_tokens == 5
    assert scheduled.start_position == 11 and seq.num_computed_tokens == 16
    updates = scheduler.update_from_output(
        out, ModelRunnerOutput(sampled={"s": SampledToken(42)}, accepted_drafts={"s": [4, 5]}))
    assert updates[0].new_token_ids == [4, 5, 42]
    assert seq.all_token_ids[-4:] == [3, 4, 5, 42]
    assert seq.num_computed_tokens == 14  # the last token and two drafts: positions 11..13
    scheduler.kv_cache.cache_computed_blocks(seq)
    assert len(seq.block_hashes) == 3  # 14 computed tokens: 3 full blocks of 4, all accepted tokens
    assert scheduler.stats().spec_decode.num_draft_tokens == 4
    assert scheduler.stats().spec_decode.num_accepted_tokens == 2


def test_a_stop_token_inside_the_accepted_run_ends_it_there_and_frees_the_blocks():
    scheduler = _scheduler()
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[5])
    seq = _prefilled(scheduler, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], params, 3)
    out = scheduler.schedule()
    assert out.scheduled[0].draft_token_ids == [4, 5, 6, 7]
    updates = scheduler.update_from_output(
        out, ModelRunnerOutput(sampled={"s": SampledToken(8)}, accepted_drafts={"s": [4, 5, 6, 7]}))
    assert updates[0].new_token_ids == [4, 5] and updates[0].finished_by_token
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 5
    assert seq.output_token_ids == [3, 4, 5]
    assert scheduler.kv_cache.pool.num_used_blocks == 0


def test_eos_inside_the_accepted_run_ends_it_unless_ignored():
    for ignore_eos, expected in ((False, [3, 4, 0]), (True, [3, 4, 0, 6, 7, 8])):
        scheduler = _scheduler()  # EOS is token 0
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=ignore_eos)
        seq = _prefilled(scheduler, [1, 2, 3, 4, 0, 6, 7, 8, 9, 1, 2], params, 3)
        out = scheduler.schedule()
        assert out.scheduled[0].draft_token_ids == [4, 0, 6, 7]
        scheduler.update_from_output(
            out, ModelRunnerOutput(sampled={"s": SampledToken(8)}, accepted_drafts={"s": [4, 0, 6, 7]}))
        assert seq.output_token_ids == expected
        assert seq.finished is not ignore_eos


def test_drafts_fit_max_tokens_and_skip_rows_that_cannot_speculate():
    scheduler = _scheduler()
    seq = _prefilled(scheduler, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], SamplingParams(temperature=0, max_tokens=3), 3)
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.draft_token_ids == [4]  # 1 of 3 output tokens so far: one draft + the target's own
    assert seq.num_computed_tokens == 13
    other = _scheduler()
    _prefilled(other, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], SamplingParams(temperature=0, max_tokens=20, logprobs=1), 3)
    assert other.schedule().scheduled[0].draft_token_ids == []


# -- the acceptance rule -------------------------------------------------------------------------
def test_rejection_sampling_emits_the_target_distribution():
    """The first emitted token (an accepted draft, or the residual's draw) is distributed as p."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1, 0.0])
    generator = torch.Generator().manual_seed(1234)
    draws = 8000
    for draft in (1, 4, 5):  # likely, unlikely, impossible drafts
        counts = Counter()
        for _ in range(draws):
            num_accepted, token = accept_drafts(p.unsqueeze(0), [draft], generator)
            counts[draft if num_accepted else token] += 1
        empirical = torch.tensor([counts[t] / draws for t in range(len(p))])
        assert counts[5] == 0  # a token p rules out is never emitted, even when drafted
        assert 0.5 * (empirical - p).abs().sum() < 0.03  # sampling noise is ~0.008 here


def test_sampled_tokens_follow_the_same_distribution_with_speculation(smollm2):
    """128 seeded completions (temperature 1) of a repetitive prompt: the first three tokens'
    joint distribution with speculation matches the one without (the 2nd token is a verified draft)."""
    prompt = smollm2.tokenizer.encode("one two three four five six seven. one two three four five six seven. "
                                      "one two three four five six seven. one two")
    params = [SamplingParams(n=64, temperature=1.0, seed=1000 * i, max_tokens=3, ignore_eos=True) for i in range(2)]
    limits = {"max_num_seqs": 256, "num_blocks": 256, "max_num_batched_tokens": 1024}
    plain, _ = _run(smollm2, None, [prompt] * 2, *params, **limits)
    spec, stats = _run(smollm2, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1), [prompt] * 2,
                       *params, **limits)
    assert stats.spec_decode.num_draft_tokens >= 100 and stats.spec_decode.num_accepted_tokens > 0
    a = Counter(tuple(c.token_ids) for o in plain for c in o.outputs)
    b = Counter(tuple(c.token_ids) for o in spec for c in o.outputs)
    tv = 0.5 * sum(abs(a[k] - b[k]) for k in a.keys() | b.keys()) / 128
    assert tv < 0.3, tv  # two samples of 128, most mass on a few outcomes: noise ~0.1-0.15


# -- SmolLM2, greedy -----------------------------------------------------------------------------
def _run(loaded, spec: SpeculativeConfig | None, prompts: list[list[int]], *params: SamplingParams,
         num_blocks: int = 128, max_num_batched_tokens: int = 256, max_num_seqs: int = 8):
    """Every prompt's final RequestOutput (params per prompt, the last one repeated) and the stats."""
    config = EngineConfig(model=ModelConfig(device="cpu", max_model_len=256), cache=CacheConfig(num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                    max_num_batched_tokens=max_num_batched_tokens),
                          speculative=spec)
    engine = LLMEngine.from_loaded(loaded, config)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params[min(index, len(params) - 1)])
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    stats = engine.stats()
    assert stats.kv_blocks_used == 0  # everything freed, preempted or not
    return [finals[str(i)] for i in range(len(prompts))], stats


def _summary(outputs) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outputs for c in o.outputs]


def test_greedy_is_token_identical_batched_chunked_and_preempted(smollm2):
    encode = smollm2.tokenizer.encode
    prompts = [encode(CODE), encode(REPEAT), encode(PLAIN), encode(REPEAT), encode(CODE), encode(PLAIN)]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    params = [greedy, greedy, greedy,
              SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),  # cannot speculate
              SamplingParams(temperature=0, max_tokens=40, logit_bias={28: -5.0}, stop=["mul"]),
              SamplingParams(temperature=0, max_tokens=40, min_tokens=10)]
    # 16 blocks of 16 tokens for six sequences of ~45-80 tokens, 32-token steps: chunked prefill and preemption
    limits = {"num_blocks": 16, "max_num_batched_tokens": 32, "max_num_seqs": 6}
    plain, plain_stats = _run(smollm2, None, prompts, *params, **limits)
    spec, stats = _run(smollm2, SPEC, prompts, *params, **limits)
    assert _summary(spec) == _summary(plain)
    assert stats.num_preemptions > 0 and plain_stats.spec_decode is None
    assert stats.spec_decode.num_accepted_tokens > 10


def test_stop_token_and_max_tokens_end_where_plain_decoding_ends(smollm2):
    prompt = smollm2.tokenizer.encode(REPEAT)
    (reference,), _ = _run(smollm2, None, [prompt], SamplingParams(temperature=0, max_tokens=12))
    tokens = reference.outputs[0].token_ids
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[4]]),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[4]], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=9)]
    plain, _ = _run(smollm2, None, [prompt] * 4, *params)
    spec, stats = _run(smollm2, SPEC, [prompt] * 4, *params)
    assert _summary(spec) == _summary(plain)
    assert plain[0].outputs[0].token_ids == tokens[:5] and plain[0].outputs[0].stop_reason == tokens[4]
    assert [len(o.outputs[0].token_ids) for o in spec[2:]] == [6, 9]
    assert stats.spec_decode.num_accepted_tokens > 0


# -- the server ----------------------------------------------------------------------------------
def test_server_streams_what_it_returns_and_exports_the_counters(smollm2):
    config = EngineConfig(model=ModelConfig(device="cpu", max_model_len=256), cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128), speculative=SPEC)
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(smollm2, config))
    with BackgroundServer(build_app(engine, ServerConfig())) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = engine.model_name
        whole = client.completions.create(model=model, prompt=REPEAT, max_tokens=24, temperature=0)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=model, prompt=REPEAT, max_tokens=24, temperature=0, stream=True) if chunk.choices)
        assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 24
        metrics = httpx.get(f"{server.url}/metrics").text
    drafts = _metric(metrics, "sits_spec_decode_draft_tokens_total")
    accepted = _metric(metrics, "sits_spec_decode_accepted_tokens_total")
    assert drafts >= accepted > 0


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize(("flag", "message"), [
    ("{not json", "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ('{"num_speculative_tokens": 4}', 'needs a "method"'),
    ('{"method": "eagle"}', "method must be one of ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "prompt_lookup_min": "2"}', "prompt_lookup_min must be a positive integer"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "exceeds prompt_lookup_max"),
    ('{"method": "ngram", "draft_model": "x"}', "unknown key(s) draft_model"),
])
def test_bad_speculative_config_is_a_one_line_error_naming_the_flag(flag, message):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--speculative-config", flag])
    with pytest.raises(ConfigError) as error:
        engine_config_from_args(args)
    assert str(error.value).startswith("--speculative-config") and message in str(error.value)
    assert "\n" not in str(error.value)


def test_speculative_config_from_the_flag_and_what_it_does_not_run_with():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'])
    assert engine_config_from_args(args).speculative == SpeculativeConfig("ngram", 3, 5, 2)
    assert engine_config_from_args(parser.parse_args(["--device", "cpu"])).speculative is None
    with pytest.raises(ConfigError, match="--speculative-config does not run with --async-scheduling"):
        EngineConfig(speculative=SPEC, async_scheduling=True).validate()
