"""Sending the benchmark's requests to an OpenAI-compatible server: streaming, timed, with vLLM's load shapes.

The client is aiohttp (its HTTP parser is C), as vLLM's benchmark client is: on a machine where the client
shares the cores with the server it measures, each of its CPU-seconds is one the server does not get.

Load (as `vllm bench serve`): request i is sent at the sum of i inter-arrival gaps drawn from a gamma
distribution of shape `burstiness` and mean 1 / `request_rate` (burstiness 1 is a Poisson process;
below 1 burstier, above 1 more regular); `request_rate` inf sends all at once. `max_concurrency`
bounds the requests in flight whatever the rate. Every request streams, with
`stream_options.include_usage` so the server's token counts are used when it gives them.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from sits.runtime.commands.bench_serve_dataset import BenchRequest
from sits.runtime.commands.bench_serve_metrics import RequestRecord

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class LoadShape:
    """How requests are released: rate in requests/s (inf: all at once), gamma shape, in-flight bound (None: none)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class Target:
    """Where and how to send: the server root URL, endpoint, model id, default key, sampling knobs."""

    base_url: str
    endpoint: str
    model: str
    api_key: str = ""
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 6 * 3600.0


def request_body(target: Target, request: BenchRequest) -> dict[str, Any]:
    """The JSON body: max_tokens (+ min_tokens and ignore_eos so the length is exact where honoured), streaming."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": request.output_len, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": target.temperature}
    if target.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = request.output_len
    if target.endpoint == "/v1/chat/completions":
        prompt = request.prompt if isinstance(request.prompt, str) else " ".join(map(str, request.prompt))
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = request.prompt
    if request.user:
        body["user"] = request.user
    return body


def _has_output(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, one per line as the server flushes them."""
    async for raw in response.content:
        if raw.startswith(b"data:"):
            yield raw[5:].strip().decode()


async def send(client: aiohttp.ClientSession, target: Target, request: BenchRequest) -> RequestRecord:
    """Send one streaming request; a RequestRecord with every output chunk's arrival time (never raises)."""
    key = request.tenant.api_key if request.tenant is not None else target.api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    record = RequestRecord(sent_s=time.perf_counter(), prompt_tokens=request.prompt_len,
                           tenant=request.tenant.name if request.tenant is not None else "")
    chunks = 0
    try:
        async with client.post(target.base_url + target.endpoint, json=request_body(target, request),
                               headers=headers) as response:
            record.status = response.status
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                record.error = body[:300] or (response.reason or "")
            else:
                async for data in _events(response):
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        record.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                        break
                    if _has_output(chunk):
                        record.chunk_times_s.append(time.perf_counter())
                        chunks += 1
                    usage = chunk.get("usage")
                    if usage:
                        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                        record.output_tokens = usage.get("completion_tokens", 0)
    except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as error:  # ValueError: bad JSON or UTF-8, an over-long line
        record.error = f"{type(error).__name__}: {error}"[:300]
    record.end_s = time.perf_counter()
    if record.ok and not record.output_tokens:
        record.output_tokens = chunks  # no usage from the server: one token per chunk
    return record


def arrival_gaps(count: int, shape: LoadShape) -> list[float]:
    """Seconds to wait before each request (the first waits 0): gamma(burstiness, 1 / (rate x burstiness))."""
    if math.isinf(shape.request_rate):
        return [0.0] * count
    rng = random.Random(shape.seed)
    theta = 1.0 / (shape.request_rate * shape.burstiness)
    return [0.0] + [rng.gammavariate(shape.burstiness, theta) for _ in range(count - 1)]


async def run_load(target: Target, requests: list[BenchRequest], shape: LoadShape,
                   on_done: Callable[[RequestRecord], None] = lambda record: None) -> tuple[list[RequestRecord], float]:
    """Send every request as `shape` releases them; (records in request order, duration in seconds)."""
    limit = shape.max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    # read_bufsize: an event line may be long (logprobs, another server's chunks); aiohttp refuses lines over 2x it
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as client:
        async def one(request: BenchRequest) -> RequestRecord:
            async with gate:
                record = await send(client, target, request)
            on_done(record)
            return record

        start = time.perf_counter()
        tasks = []
        for gap, request in zip(arrival_gaps(len(requests), shape), requests, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request)))
        records = list(await asyncio.gather(*tasks))
        end = max((r.end_s for r in records), default=start)
    return records, end - start


async def _get(url: str, api_key: str) -> tuple[int, str]:
    """(status, body text) of one GET within 30 s; raises aiohttp.ClientError, TimeoutError or UnicodeDecodeError."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30.0)) as client,
                client.get(url, headers=headers) as response):
        return response.status, await response.text()


async def read_metrics(base_url: str, api_key: str = "") -> dict[str, float] | None:
    """The server's /metrics summed by name, or None when it has none (another server, or an error)."""
    from sits.runtime.commands.bench_serve_metrics import parse_prometheus

    try:
        status, text = await _get(base_url + "/metrics", api_key)
    except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
        return None
    return parse_prometheus(text) if status == 200 else None


async def served_model(base_url: str, api_key: str = "") -> str:
    """The first model id of /v1/models. Raises RuntimeError when the server does not answer with one."""
    try:
        _, text = await _get(base_url + "/v1/models", api_key)
        return str(json.loads(text)["data"][0]["id"])
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as error:
        raise RuntimeError(f"cannot read the model id from {base_url}/v1/models ({error}); give --model") from None
