"""KV-cache exhaustion: far more KV than the cache holds is asked for at once; the engine preempts and
recomputes, every request still gets all its tokens, nothing crashes, and every block comes back.

A real `sits serve` process (tiny random Llama) with 8 blocks of 16 tokens (128 tokens of KV) and
8 sequences allowed to run: 8 concurrent requests of ~60 tokens each need ~32 blocks (two fit at once).
"""

from __future__ import annotations

import concurrent.futures

import httpx

from benchmarks.server_process import engine_leftovers

CLIENTS, MAX_TOKENS = 8, 50


def complete(url: str, index: int) -> httpx.Response:
    body = {"prompt": [100 + index] * 10, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=180)


def preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sits_preemptions_total"))


def test_a_cache_far_too_small_preempts_and_every_request_still_completes(serve_tiny):
    with serve_tiny("--num-blocks", "8", "--block-size", "16", "--max-num-seqs", "8", "--max-model-len", "128",
                    "--max-num-batched-tokens", "128") as server:
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            responses = list(pool.map(lambda i: complete(server.url, i), range(CLIENTS)))
        assert [r.status_code for r in responses] == [200] * CLIENTS, [r.text[:200] for r in responses]
        for response in responses:
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
        preempted = preemptions(server.url)
        print(f"{CLIENTS} x {MAX_TOKENS} tokens in 128 tokens of KV: all 200, {preempted:.0f} preemptions")
        assert preempted > 0  # the cache really ran out
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert not any(engine_leftovers(server.url).values())
        assert server.process.poll() is None and "Traceback" not in (server.workdir / "serve.log").read_text()
