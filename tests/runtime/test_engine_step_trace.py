"""SITS_ENGINE_STEP_TRACE: each step's composition, written by the served engine process.

In process: the engine's step_observer sees every scheduled step, and the lines add up to the requests that
ran. Served: `sits serve` with the variable set writes the file from its engine process, complete once the
server stopped.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time

import httpx

from sits.runtime.engine.request import SamplingParams
from sits.runtime.engine.step_trace import STEP_TRACE_ENV, StepComposition, StepTrace, read_step_trace
from tests.support.models import dummy_engine
from tests.support.services import free_port, started


def test_the_lines_add_up_to_the_requests_that_ran(tmp_path):
    trace = StepTrace(tmp_path / "steps.jsonl")
    engine, _ = dummy_engine("--batch", "4", "--input-len", "48", "--output-len", "8", "--num-blocks", "64",
                             "--max-num-batched-tokens", "32", "--no-async-scheduling", step_observer=trace.observe)
    trace.attach(engine)
    params = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5, ignore_eos=True)
    for index, length in enumerate((20, 30, 40)):  # no shared prefix: nothing comes from the prefix cache
        engine.add_request(f"r{index}", list(range(3 + 100 * index, 3 + 100 * index + length)), params)
    while engine.has_unfinished_requests():
        engine.step()
        trace.stamp()
    trace.close()
    lines = read_step_trace(tmp_path / "steps.jsonl")
    assert sum(line["prompt_tokens"] for line in lines) == 90  # each prompt computed once, in chunks of <= 32
    assert max(line["prompt_tokens"] for line in lines) <= 32
    assert sum(line["new_sequences"] for line in lines) == 3
    assert sum(line["decodes"] for line in lines) == 3 * 4  # the first token comes from the prompt's last chunk
    assert [line["t_s"] for line in lines] == sorted(line["t_s"] for line in lines)
    assert lines[0]["waiting"] >= 1 and lines[-1]["waiting"] == 0


def _traced_engine(path, scheduling_flag: str, seen: list):
    """A tiny engine whose steps go to a StepTrace at `path` and, as observed, to `seen`; two prompts added."""
    trace = StepTrace(path)

    def observe(output):
        seen.append(StepComposition.of(output))
        trace.observe(output)

    engine, _ = dummy_engine("--batch", "4", "--input-len", "48", "--output-len", "8", "--num-blocks", "64",
                             "--max-num-batched-tokens", "32", scheduling_flag, step_observer=observe)
    trace.attach(engine)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, ignore_eos=True)
    for index in range(2):
        engine.add_request(f"r{index}", list(range(3 + 100 * index, 43 + 100 * index)), params)
    return engine, trace


def test_each_line_is_written_by_the_call_that_completes_its_step(tmp_path):
    """With async scheduling a step call launches one step and completes the one before: the line of a step
    (and so the gap that times it) comes from the later call, and the last step's from the call that only
    completes it. Without it, the same call."""
    for flag, lines_after_first_call in (("--async-scheduling", 0), ("--no-async-scheduling", 1)):
        engine, trace = _traced_engine(tmp_path / f"first{flag}.jsonl", flag, [])
        engine.step()
        trace.stamp()
        trace.close()
        assert len(read_step_trace(trace.path)) == lines_after_first_call, flag
    seen: list[StepComposition] = []
    engine, trace = _traced_engine(tmp_path / "all.jsonl", "--async-scheduling", seen)
    while engine.has_unfinished_requests():
        engine.step()
        trace.stamp()
    trace.close()
    lines = read_step_trace(trace.path)
    assert [StepComposition(line["decodes"], line["prompt_tokens"], line["new_sequences"], line["context_tokens"])
            for line in lines] == seen  # every step once, in order, the last one included
    assert sum(line["prompt_tokens"] for line in lines) == 80


def test_sits_serve_writes_the_trace_from_its_engine_process(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime.cli", "serve", "--load-format", "dummy", "--config", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--num-blocks", "64", "--max-num-seqs", "4"]
    traces = tmp_path / "traces"
    with started(argv, port, timeout_s=120.0, env={STEP_TRACE_ENV: str(traces)}) as service:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            time.sleep(0.1)
        for prompt in ([5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 32))):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "min_tokens": 4, "temperature": 0.0}
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        service.stop()  # SIGTERM: the server drains, the engine's loop ends and the trace is closed
    files = list(traces.glob("engine-*-steps.jsonl"))
    assert len(files) == 1
    lines = read_step_trace(files[0])
    assert sum(line["prompt_tokens"] for line in lines) == 20 and sum(line["decodes"] for line in lines) == 6


def test_the_report_times_each_step_from_the_line_before_and_classes_them(tmp_path, capsys):
    from benchmarks import step_trace_report

    lines = [{"t_s": 0.0, "decodes": 0, "prompt_tokens": 8192, "new_sequences": 8},
             {"t_s": 0.020, "decodes": 256, "prompt_tokens": 0, "new_sequences": 0},
             {"t_s": 0.080, "decodes": 250, "prompt_tokens": 768, "new_sequences": 1},
             {"t_s": 0.100, "decodes": 251, "prompt_tokens": 0, "new_sequences": 0}]
    summary = step_trace_report.summarise(lines)
    assert summary["steps"] == 3 and summary["mean_decodes"] == (256 + 250 + 251) / 3
    assert summary["long_step_time_share"] == 0.6  # the 60 ms mixed step of 100 ms
    mixed = summary["classes"]["decodes + <= 1024 prompt tokens"]
    assert mixed["steps"] == 1 and mixed["time_share"] == 0.6 and abs(mixed["max_ms"] - 60.0) < 1e-9
    assert summary["classes"]["decode only"]["steps"] == 2
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "engine-7-steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert step_trace_report.main([str(folder)]) == 0
    assert "engine-7-steps.jsonl: 3 steps" in capsys.readouterr().out
