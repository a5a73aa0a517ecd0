"""benchmarks/profile_decode.py's mixed steps, on the CPU: each measured step prefills one fresh prompt (or K of
them) beside an unchanged decode batch (the steps a served engine runs while streams arrive)."""

from __future__ import annotations

import pytest

from benchmarks import profile_decode
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.step_trace import StepComposition
from tests.support.models import dummy_engine


@pytest.mark.parametrize("per_step", [1, 3])
def test_each_mixed_step_prefills_new_prompts_beside_the_same_decodes(per_step):
    from sits.runtime.commands import bench

    steps: list[StepComposition] = []
    engine, loaded = dummy_engine("--batch", "4", "--input-len", "48", "--output-len", "64", "--num-blocks", "128",
                                  "--max-num-seqs", str(4 + per_step), "--no-async-scheduling",
                                  step_observer=lambda output: steps.append(StepComposition.of(output)))
    params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64, ignore_eos=True)
    profile_decode._start_decoding(engine, bench.random_prompts(4, 48, loaded.config.vocab_size, 7), params)
    step = profile_decode._mixed_stepper(engine, 16, per_step, 6, loaded.config.vocab_size)
    del steps[:]
    for _ in range(6):
        step()
    assert [(s.decodes, s.prompt_tokens, s.new_sequences) for s in steps] == [(4, 16 * per_step, per_step)] * 6
    assert [b.context_tokens - a.context_tokens for a, b in zip(steps, steps[1:], strict=False)] == [4] * 5
    assert engine.num_unfinished_requests == 4  # each one-token answer left after its prefill
    assert profile_decode._mixed_stepper(engine, 0, 1, 6, loaded.config.vocab_size) == engine.step


def test_mixed_prompts_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile_decode._parse_args(["--config", "tiny", "--mixed-prompt-tokens", "16", "--mixed-prompts", "0"])
    assert exit_info.value.code == 2
    assert "--mixed-prompts must be at least 1" in capsys.readouterr().err
