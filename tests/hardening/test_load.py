"""Load with admission control: more streaming clients than the server admits, some leaving mid-stream.

`benchmarks/load_test.py` drives a real `sits serve` process (tiny random Llama, 4 running + 8 waiting
sequences) with 40 clients for ~5 s. What users rely on: every refusal is a 429/503 in OpenAI's
shape with Retry-After, no other 5xx, every admitted stream that the client kept ends with a
finish_reason and [DONE], the server's memory stays bounded, and once the load ends every
sequence, KV block and admission slot is free again.
"""

from __future__ import annotations

import asyncio

from benchmarks.load_client import LoadConfig, warm_up
from benchmarks.load_test import run_load

CLIENTS, DURATION_S = 40, 5.0
RSS_GROWTH_LIMIT_MB = 150  # the tiny model's steady state moves by tens of MB; a leak per request would not stay under


def test_a_bounded_queue_refuses_cleanly_and_the_server_releases_everything(serve_tiny):
    with serve_tiny("--max-num-seqs", "4", "--max-waiting-requests", "8", "--max-num-batched-tokens", "256") as server:
        config = LoadConfig(url=server.url, clients=CLIENTS, duration_s=DURATION_S, max_tokens=24,
                            disconnect_every=4, max_retry_wait_s=0.5)
        warm_up(server.url, config)
        report = asyncio.run(run_load(config, pid=server.process.pid))
        print(report.format())  # the figures, under -s
        figures = report.figures()
        assert figures["admitted"] >= 10 and figures["refused"] >= 10  # both paths were exercised
        assert set(figures["statuses"]) <= {"200", "503"}
        assert report.failures == [] and figures["refusals_well_formed"]
        assert report.incomplete == []
        assert figures["disconnected"] >= 2  # streams dropped mid-way, whose blocks must come back too
        assert report.server.drained, report.server.leftover
        assert report.server.rss_after_mb - report.server.rss_before_mb < RSS_GROWTH_LIMIT_MB
        assert server.process.poll() is None
        assert "Traceback" not in (server.workdir / "serve.log").read_text()
