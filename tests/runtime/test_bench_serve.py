"""`sits serve --load-format dummy` and `sits bench serve` against it: a real server process (random
weights of the `tiny` shape, token-id tokenizer), the official openai client, and the benchmark's
figures checked against the per-request timestamps it records."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from sits.runtime import cli
from sits.runtime.commands.bench_serve_metrics import (
    RequestRecord,
    compute_report,
    format_report,
    parse_goodput,
    percentile,
    server_counters,
    summary_ms,
)
from tests.support.services import free_port, started

TINY_VOCAB = 512


def wait_healthy(url: str, service, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert service.process.poll() is None, "the server exited while loading"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError("the dummy server was not healthy in time")


@pytest.fixture(scope="module")
def dummy_server():
    """`sits serve --load-format dummy --config tiny` on a free port (one per module)."""
    port = free_port()
    argv = [sys.executable, "-m", "sits.runtime.cli", "serve", "--load-format", "dummy", "--config", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--num-blocks", "512", "--max-num-seqs", "16"]
    with started(argv, port, timeout_s=120.0) as service:
        wait_healthy(service.url, service)
        yield service.url


@pytest.fixture(scope="module")
def client(dummy_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=dummy_server + "/v1", api_key="none", max_retries=0)


def bench(tmp_path: Path, *args: str) -> dict:
    """Run `sits bench serve ARGS --json FILE` in this process; the JSON it wrote."""
    out = tmp_path / f"bench-{uuid.uuid4().hex[:8]}.json"
    assert cli.main(["bench", "serve", *args, "--no-progress", "--json", str(out)]) == 0
    return json.loads(out.read_text())


# -- the dummy server -------------------------------------------------------------------------

def test_completions_take_token_id_prompts_and_answer_ids(client):
    answer = client.completions.create(model="tiny", prompt=[5, 17, 42, 9], max_tokens=6, temperature=0.0)
    ids = [int(part) for part in answer.choices[0].text.split()]
    assert len(ids) == 6 and all(0 <= i < TINY_VOCAB for i in ids)
    assert answer.usage.prompt_tokens == 4 and answer.usage.completion_tokens == 6
    as_text = client.completions.create(model="tiny", prompt="5 17 42 9", max_tokens=6, temperature=0.0)
    assert as_text.choices[0].text == answer.choices[0].text  # text of ids is the same prompt


def test_a_stream_is_ids_separated_by_spaces(client):
    stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=5, stream=True,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices and chunk.choices[0].text]
    # one id per chunk, or several when the client fell behind the engine (the missed steps come merged)
    assert all(p.startswith(" ") and all(part.isdigit() for part in p.split()) for p in pieces)
    assert len("".join(pieces).split()) == 5
    whole = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=5, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].text


def test_chats_render_to_their_ids_and_words_are_a_400(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "3 4"},
                                                                  {"role": "user", "content": "5 6 7"}], max_tokens=3)
    assert chat.usage.prompt_tokens == 5 and len(chat.choices[0].message.content.split()) == 3
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=3)
    assert error.value.body["param"] == "messages" and "token ids" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="hello world", max_tokens=3)
    assert error.value.body["param"] == "prompt"


def test_tokenize_and_detokenize_speak_ids(dummy_server):
    tokens = httpx.post(dummy_server + "/tokenize", json={"model": "tiny", "prompt": "7 8 9",
                                                          "return_token_strs": True}).json()
    assert tokens["tokens"] == [7, 8, 9] and tokens["count"] == 3 and tokens["token_strs"] == ["7", "8", "9"]
    text = httpx.post(dummy_server + "/detokenize", json={"model": "tiny", "tokens": [7, 8, 9]}).json()
    assert text["prompt"] == " 7 8 9"


@pytest.mark.parametrize(("argv", "message"), [
    (["--config", "tiny"], "--config NAME needs --load-format dummy"),
    (["--load-format", "dummy"], "--load-format dummy needs --config NAME"),
    (["--load-format", "dummy", "--config", "tiny", "--model", "/x"], "--model and --load-format dummy"),
    (["--load-format", "dummy", "--config", "nope"], "unknown model config 'nope'"),
])
def test_bad_load_format_combinations_are_one_line_errors(argv, message, capsys):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sits serve: error: ") and message in err and "\n" not in err


# -- sits bench serve -------------------------------------------------------------------------

def test_random_dataset_counts_exact_lengths_and_metric_math(dummy_server, tmp_path):
    result = bench(tmp_path, "--base-url", dummy_server, "--vocab-size", "512", "--num-prompts", "12", "--max-concurrency", "4",
                   "--random-input-len", "24", "--random-output-len", "10", "--goodput", "ttft:60000", "tpot:60000")
    figures, records = result["results"], [RequestRecord(**r) for r in result["requests"]]
    assert figures["completed"] == 12 and figures["failed"] == 0 and len(records) == 12
    # a chunk per token, fewer when the client fell behind the engine (the server merges the steps it missed)
    assert all(r.output_tokens == 10 and 1 <= len(r.chunk_times_s) <= 10 and r.prompt_tokens == 24 for r in records)
    assert figures["total_output_tokens"] == 120 and figures["total_input_tokens"] == 288
    duration = figures["duration_s"]
    assert duration >= max(r.e2el_s for r in records)
    assert figures["output_throughput"] == pytest.approx(120 / duration)
    assert figures["total_token_throughput"] == pytest.approx(408 / duration)
    ttfts = [r.chunk_times_s[0] - r.sent_s for r in records]
    assert figures["ttft_ms"]["mean"] == pytest.approx(1000 * sum(ttfts) / 12)
    tpots = [(r.end_s - r.chunk_times_s[0]) / 9 for r in records]
    assert figures["tpot_ms"]["median"] == pytest.approx(1000 * percentile(tpots, 50))
    # ITL: the gaps between the chunks this run saw (none when the server merged every answer into one chunk,
    # which a loaded machine can make happen; test_report_itl_is_every_gap_between_chunks fixes the math)
    gaps = [b - a for r in records for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:], strict=False)]
    assert len(gaps) == sum(len(r.chunk_times_s) - 1 for r in records)
    if gaps:
        assert figures["itl_ms"]["p99"] == pytest.approx(1000 * percentile(gaps, 99))
    else:  # no gap to take a percentile of: the report says so with None
        assert figures["itl_ms"]["p99"] is None
    assert figures["good_requests"] == 12 and figures["request_goodput"] == pytest.approx(12 / duration)
    assert figures["preemptions"] == 0 and figures["prefix_cache_hit_rate"] is not None
    assert result["setup"]["max_concurrency"] == 4 and result["setup"]["dataset"] == "random"
    # where the time went, from the server's /metrics: at least one engine step per token of the longest answer,
    # each process's CPU, and the tokens per chunk the client counted
    assert figures["engine_steps"] >= 10
    assert figures["mean_engine_step_ms"] == pytest.approx(1000 * duration / figures["engine_steps"])
    assert figures["engine_cpu_cores"] > 0 and figures["server_cpu_cores"] > 0
    assert figures["output_tokens_per_chunk"] == pytest.approx(120 / sum(len(r.chunk_times_s) for r in records))


def test_goodput_counts_only_requests_within_every_slo(dummy_server, tmp_path):
    result = bench(tmp_path, "--base-url", dummy_server, "--vocab-size", "512", "--num-prompts", "6", "--random-input-len", "8",
                   "--random-output-len", "4", "--goodput", "ttft:0.001", "e2el:60000")
    assert result["results"]["completed"] == 6 and result["results"]["good_requests"] == 0


def test_a_wrong_model_name_is_counted_as_404s(dummy_server, tmp_path):
    result = bench(tmp_path, "--base-url", dummy_server, "--vocab-size", "512", "--model", "no-such-model", "--num-prompts", "5",
                   "--random-input-len", "8", "--random-output-len", "4")
    assert result["results"]["completed"] == 0 and result["results"]["failed_by_status"] == {"404": 5}
    assert all("no-such-model" in r["error"] for r in result["requests"])


def test_prefix_repetition_hits_each_tenants_prefix_at_a_poisson_rate(dummy_server, tmp_path):
    result = bench(tmp_path, "--base-url", dummy_server, "--vocab-size", "512", "--dataset-name", "prefix-repetition", "--num-tenants", "2",
                   "--users-per-tenant", "3", "--prefix-len", "64", "--random-input-len", "8",
                   "--random-output-len", "4", "--num-prompts", "12", "--request-rate", "200",
                   "--endpoint", "/v1/chat/completions")
    figures = result["results"]
    assert figures["completed"] == 12 and figures["total_input_tokens"] == 12 * 72
    assert sorted({r["tenant"] for r in result["requests"]}) == ["bench-tenant-0", "bench-tenant-1"]
    assert figures["prefix_cache_hit_rate"] > 0.5  # 10 of 12 prompts find their tenant's 64 tokens cached


def test_a_launched_server_that_cannot_start_is_a_one_line_error_and_leaves_no_process(capsys):
    marker = f"broken-{uuid.uuid4().hex[:8]}"
    assert cli.main(["bench", "serve", "--launch", f"--load-format dummy --served-model-name {marker}",
                     "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sits bench serve: error: --launch: the server exited with 2") and "\n" not in err
    assert "--config NAME" in err
    assert not [p for p in Path("/proc").glob("[0-9]*") if marker in _cmdline(p)]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-prompts", "0"], "--num-prompts must be positive"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio must be in [0, 1)"),
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--goodput", "ttft"], "--goodput: 'ttft' is not KEY:MS"),
    (["--goodput", "latency:5"], "--goodput: 'latency:5'"),
    (["--launch", "x", "--base-url", "http://127.0.0.1:1"], "--launch and --base-url"),
    (["--tenants-file", "t.yaml"], "--tenants-file needs --dataset-name prefix-repetition"),
])
def test_bad_bench_flags_are_one_line_errors(argv, message, capsys):
    assert cli.main(["bench", "serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sits bench serve: error: ") and message in err and "\n" not in err


def test_percentiles_and_goodput_parsing_follow_vllm():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert math.isnan(summary_ms([])["p99"])
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1000"]) == {"ttft": 0.2, "tpot": 0.05, "e2el": 1.0}
    record = RequestRecord(sent_s=0.0, end_s=1.0, chunk_times_s=[0.2, 0.6, 1.0], output_tokens=5, status=200)
    assert record.tpot_s == pytest.approx(0.2) and record.itl_s == pytest.approx([0.4, 0.4])


def test_report_itl_is_every_gap_between_chunks():
    records = [RequestRecord(sent_s=0.0, end_s=1.0, chunk_times_s=[0.1, 0.4, 1.0], output_tokens=6, status=200),
               RequestRecord(sent_s=0.5, end_s=0.9, chunk_times_s=[0.9], output_tokens=3, status=200),  # one merged chunk
               RequestRecord(sent_s=0.2, end_s=0.3, status=503, error="overloaded")]
    report = compute_report(records, 2.0, {}, {})
    gaps = [0.3, 0.6]  # the failed request's and the one-chunk answer's add none
    assert report["itl_ms"]["mean"] == pytest.approx(450.0)
    assert report["itl_ms"]["p99"] == pytest.approx(1000 * percentile(gaps, 99))
    assert report["completed"] == 2 and report["failed_by_status"] == {"503": 1}
    assert math.isnan(compute_report(records[1:], 2.0, {}, {})["itl_ms"]["p99"])


def test_load_figures_tell_engine_steps_from_server_cpu():
    records = [RequestRecord(sent_s=0.0, end_s=1.0, chunk_times_s=[0.1, 0.4, 1.0], output_tokens=6, status=200),
               RequestRecord(sent_s=0.5, end_s=0.9, chunk_times_s=[0.9], output_tokens=2, status=200)]
    before = {"sits_engine_steps_total": 100.0, "sits_engine_cpu_seconds_total": 3.0, "process_cpu_seconds_total": 7.5}
    after = {"sits_engine_steps_total": 180.0, "sits_engine_cpu_seconds_total": 4.0, "process_cpu_seconds_total": 9.0}
    counters = server_counters(before, after)
    assert (counters["engine_steps"], counters["engine_cpu_s"], counters["server_cpu_s"]) == (80.0, 1.0, 1.5)
    report = compute_report(records, 2.0, {}, counters)
    assert report["mean_engine_step_ms"] == pytest.approx(25.0)  # 2 s over 80 steps
    assert report["engine_cpu_cores"] == pytest.approx(0.5) and report["server_cpu_cores"] == pytest.approx(0.75)
    assert report["output_tokens_per_chunk"] == pytest.approx(2.0)  # 8 tokens in 4 chunks
    unknown = compute_report(records, 2.0, {}, server_counters(None, None))  # a server without these series
    assert unknown["mean_engine_step_ms"] is None and unknown["server_cpu_cores"] is None
    assert "Mean engine step (ms):" in format_report(report) and "n/a" in format_report(unknown)


def test_launch_serves_text_prompts_on_the_embedded_model_and_leaves_no_process(tmp_path):
    marker = f"launched-{uuid.uuid4().hex[:8]}"
    result = bench(tmp_path, "--launch", f"--max-model-len 256 --num-blocks 64 --max-num-seqs 4 --served-model-name "
                   f"{marker}", "--prompt-format", "text", "--num-prompts", "3", "--random-input-len", "16",
                   "--random-output-len", "4")
    figures = result["results"]
    assert result["setup"]["model"] == marker and figures["completed"] == 3
    assert all(r["output_tokens"] == 4 for r in result["requests"])
    # words of the list are mostly one token each; the figure is the server's own count (usage)
    assert all(12 <= r["prompt_tokens"] <= 40 for r in result["requests"])
    assert not [p for p in Path("/proc").glob("[0-9]*") if marker in _cmdline(p)]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_a_launched_run_stops_its_server(signum):
    marker = f"interrupted-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "sits.runtime.cli", "bench", "serve", "--launch",
            f"--load-format dummy --config tiny --served-model-name {marker}", "--num-prompts", "200",
            "--max-concurrency", "2", "--random-input-len", "8", "--random-output-len", "16", "--no-progress"]
    # the first progress line comes at a tenth of the prompts; the other nine tenths outlast the signal
    # Ctrl-C's default action in the child even when this run inherited SIGINT ignored (a background job)
    bench_process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = bench_process.stderr.readline()  # the first progress line: the load is running
        assert "requests done" in first, first
        assert [p for p in Path("/proc").glob("[0-9]*") if marker in _cmdline(p)]
        bench_process.send_signal(signum)
        assert bench_process.wait(timeout=120) in (130, 128 + signum)
    finally:
        if bench_process.poll() is None:
            bench_process.kill()
            bench_process.wait()
    assert not [p for p in Path("/proc").glob("[0-9]*") if marker in _cmdline(p)]


def test_tenants_from_a_file_send_their_own_keys_to_a_server_that_checks_them(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - {name: alpha, apiKey: sk-alpha, kvCacheShare: 0.4}\n"
                       "  - {name: beta, apiKey: sk-beta, kvCacheShare: 0.4}\n")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("tenants:\n  - {name: alpha, apiKey: sk-not-alpha}\n")
    port = free_port()  # one server for both runs (--launch is covered above)
    argv = [sys.executable, "-m", "sits.runtime.cli", "serve", "--load-format", "dummy", "--config", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--tenants", str(tenants)]
    with started(argv, port, timeout_s=120.0) as service:
        wait_healthy(service.url, service)
        result = bench(tmp_path, "--base-url", service.url, "--vocab-size", str(TINY_VOCAB),
                       "--dataset-name", "prefix-repetition", "--tenants-file", str(tenants), "--prefix-len", "32",
                       "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "3")
        assert result["results"]["completed"] == 6  # every key was accepted: each request carried its tenant's
        assert [r["tenant"] for r in result["requests"]] == ["alpha", "beta"] * 3
        result = bench(tmp_path, "--base-url", service.url, "--vocab-size", str(TINY_VOCAB),
                       "--dataset-name", "prefix-repetition", "--tenants-file", str(wrong), "--model", "tiny",
                       "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "3")
        assert result["results"]["failed_by_status"] == {"401": 3}
