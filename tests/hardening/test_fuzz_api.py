"""Fuzzing the API of a real `sits serve` process (tiny random Llama): N requests -> 0 responses 5xx.

Schemathesis builds requests from the server's own OpenAPI schema (valid and schema-breaking ones,
for every operation); the hand-written hostile cases (`benchmarks/fuzz_api.py`) are what such a
fuzzer rarely builds: 10 MB bodies, n = 1000, invalid UTF-8, JSON nested 100,000 deep, ... Every
answer must be a non-5xx, every /v1 error in OpenAI's shape, each hostile case answered in well
under a second of server work, the server alive afterwards and its memory back to its baseline.
The longer sweep is `python benchmarks/fuzz_api.py --serve "..." --examples 1000` (README).
"""

from __future__ import annotations

import httpx

from benchmarks.fuzz_api import hostile_sweep, schema_sweep
from benchmarks.server_process import rss_mb

EXAMPLES = 20  # per operation and mode: every operation in both modes, ~200 schema requests
RSS_SLACK_MB = 64  # allocator noise of a ~500 MB process; a 10 MB body kept per request would exceed it at once
SLOW_CASE_S = 10.0  # each hostile case is refused before any expensive work (a 10 MB prompt took 25 s before)


def test_fuzzing_yields_no_server_error_and_memory_returns_to_baseline(serve_tiny):
    with serve_tiny("--max-num-seqs", "4", "--max-model-len", "128") as server:
        pid = server.process.pid
        # timed on the first sweep (the stricter one: nothing warm yet), which also sets the allocator's
        # high-water mark for the largest bodies before the baseline is read
        timings: dict[str, float] = {}
        report = hostile_sweep(server.url, on_case=lambda name, response, seconds: timings.update({name: seconds}))
        baseline = rss_mb(pid)
        report.merge(schema_sweep(server.url, EXAMPLES, seed=0))
        report.merge(hostile_sweep(server.url))
        after = rss_mb(pid)
        print(f"{report.requests} requests -> {report.server_errors} responses 5xx; statuses "
              f"{dict(sorted(report.statuses.items()))}; RSS {baseline} -> {after} MB")
        assert report.requests >= 150
        assert report.server_errors == 0 and report.findings == [], "\n".join(map(str, report.findings))
        assert {200, 400, 404} <= set(report.statuses)  # valid, invalid and unknown-resource paths were all reached
        assert max(timings.values()) < SLOW_CASE_S, timings
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200 and server.process.poll() is None
        assert after - baseline < RSS_SLACK_MB
        assert "Traceback" not in (server.workdir / "serve.log").read_text()
