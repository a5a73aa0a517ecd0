"""benchmarks/sim_decode_budget.py at a tiny size: the real scheduler under a modelled clock.

The clock is modelled, the engine is not: the steps it traces are the scheduler's own, so the prompt-token cap
beside decodes must hold in them, every token is counted once, and the figures follow from the stamps.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import sim_decode_budget as sim
from sits.runtime.engine.step_trace import StepComposition

SMALL = ["--batch", "8", "--input-len", "64", "--output-len", "12", "--prompts", "24",
         "--max-num-batched-tokens", "128", "--num-blocks", "256", "--min-decodes", "2"]


def test_step_cost_adds_its_terms():
    cost = sim.StepCost(fixed_ms=4.0, per_decode_ms=0.01, kv_ms_per_mtoken=30.0, per_prompt_token_ms=0.02,
                        mixed_fixed_ms=7.0)
    assert cost.ms(decodes=0, context_tokens=0, prompt_tokens=0) == pytest.approx(4.0)
    assert cost.ms(decodes=0, context_tokens=0, prompt_tokens=500) == pytest.approx(4.0 + 10.0)  # prefill only
    assert cost.ms(decodes=100, context_tokens=2_000_000, prompt_tokens=0) == pytest.approx(4.0 + 1.0 + 60.0)
    assert cost.ms(decodes=100, context_tokens=2_000_000, prompt_tokens=500) == pytest.approx(4.0 + 1.0 + 60.0 + 10.0 + 7.0)


def test_the_cap_holds_in_every_traced_step_and_every_token_is_stamped():
    args = sim.parse_args(SMALL + ["--budgets", "16"])
    args.max_prefill_tokens_with_decodes = 16
    from sits.runtime.commands import bench
    from sits.runtime.engine.engine import LLMEngine

    config = bench.build_config(args)
    loaded = bench.load(args, config)
    traced: list[StepComposition] = []
    engine = LLMEngine.from_loaded(loaded, config, step_observer=lambda out: traced.append(StepComposition.of(out)))
    prompts = bench.random_prompts(24, 64, loaded.config.vocab_size, 1)
    run = sim.run_virtual(engine, traced, prompts, 12, 8, sim.StepCost())
    assert traced and all(step.prompt_tokens <= 16 for step in traced if step.decodes >= 2)
    assert any(step.prompt_tokens > 16 for step in traced)  # beside fewer decodes the step fills up
    assert len(run.ttft_ms) == 24 and len(run.itl_ms) == 24 * 11  # one gap per token after the first
    assert sum(step.prompt_tokens for step in traced) == 24 * 64  # each prompt prefilled once (no preemption)


def test_sweep_prints_and_writes_one_row_per_cap(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert sim.main(SMALL + ["--budgets", "0,16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["cap"] for r in rows] == [0, 16]
    for r in rows:
        assert r["ratio"] == pytest.approx(r["served_tok_s"] / r["offline_tok_s"])
        assert r["itl_p99_over_p50"] == pytest.approx(r["itl_p99_ms"] / r["itl_p50_ms"])
        assert 0 <= r["gaps_over_50ms"] <= 1 and r["offline_steps"] < r["served_steps"]
    printed = capsys.readouterr().out
    assert "| none |" in printed and "| 16 (M = 2) |" in printed


def test_a_bad_budget_list_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sim.parse_args(["--budgets", "512,lots"])
    assert exit_info.value.code == 2 and "--budgets" in capsys.readouterr().err
