"""benchmarks/profile_decode.py's mixed steps, on the CPU: each measured step prefills one fresh prompt beside an
unchanged decode batch (the steps a served engine runs while streams arrive)."""

from __future__ import annotations

from benchmarks import profile_decode
from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.step_trace import StepComposition
from tests.support.models import dummy_engine


def test_each_mixed_step_prefills_one_new_prompt_beside_the_same_decodes():
    from sits.runtime.commands import bench

    steps: list[StepComposition] = []
    engine, loaded = dummy_engine("--batch", "4", "--input-len", "48", "--output-len", "64", "--num-blocks", "128",
                                  "--max-num-seqs", "5", "--no-async-scheduling",
                                  step_observer=lambda output: steps.append(StepComposition.of(output)))
    params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64, ignore_eos=True)
    profile_decode._start_decoding(engine, bench.random_prompts(4, 48, loaded.config.vocab_size, 7), params)
    step = profile_decode._mixed_stepper(engine, 16, 6, loaded.config.vocab_size)
    del steps[:]
    for _ in range(6):
        step()
    assert [(s.decodes, s.prompt_tokens, s.new_sequences) for s in steps] == [(4, 16, 1)] * 6
    assert [b.context_tokens - a.context_tokens for a, b in zip(steps, steps[1:], strict=False)] == [4] * 5
    assert engine.num_unfinished_requests == 4  # each one-token answer left after its prefill
    assert profile_decode._mixed_stepper(engine, 0, 6, loaded.config.vocab_size) == engine.step
