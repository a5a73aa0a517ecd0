"""The load generator: streaming clients that loop until a deadline, each request's outcome recorded.

A 429 or 503 must be a well-formed refusal (OpenAI's error JSON and a Retry-After header); the
client then waits that long (capped) and tries again, as the official client does. Every
`disconnect_every`-th request of a client is dropped after its first event (a client that goes
away mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

PROMPTS = ["What is the capital of France?", "Why is the sky blue?", "Write a haiku about autumn leaves.",
           "Explain photosynthesis to a child.", "How do airplanes fly?", "Name three planets and a fact each.",
           "Tell me a short joke.", "How do bees make honey?", "What is gravity?", "Describe a cat in one sentence."]
REFUSALS = (429, 503)


@dataclass
class LoadConfig:
    """What to send. `max_retry_wait_s` caps how long a refused client honours Retry-After."""

    url: str
    clients: int = 40
    duration_s: float = 10.0
    max_tokens: int = 32
    endpoint: str = "chat"  # chat | completions
    model: str | None = None
    api_key: str | None = None
    disconnect_every: int = 0  # 0: never drop a stream
    max_retry_wait_s: float = 2.0
    request_timeout_s: float = 300.0
    seed: int = 0


@dataclass
class Outcome:
    """One request: its status and, when admitted, its timings (seconds) and whether it ended cleanly."""

    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    complete: bool = False  # a finish_reason and then [DONE]: nothing half-written
    disconnected: bool = False  # this client dropped the stream on purpose
    refusal_ok: bool | None = None  # for 429 / 503: OpenAI error JSON + Retry-After
    error: str | None = None


def well_formed_refusal(response: httpx.Response, body: bytes) -> bool:
    """OpenAI's error JSON ({"error": {message, type, param, code}}) and an integer Retry-After >= 1."""
    try:
        error = json.loads(body)["error"]
        shaped = set(error) == {"message", "type", "param", "code"} and bool(error["message"])
    except (ValueError, KeyError, TypeError):
        return False
    retry_after = response.headers.get("retry-after", "")
    return shaped and retry_after.isdigit() and int(retry_after) >= 1


def request_body(config: LoadConfig, rng: random.Random) -> tuple[str, dict]:
    prompt = rng.choice(PROMPTS)
    common = {"max_tokens": config.max_tokens, "stream": True, "temperature": 0.8, "ignore_eos": True,
              **({"model": config.model} if config.model else {})}
    if config.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


async def one_request(http: httpx.AsyncClient, config: LoadConfig, rng: random.Random, drop: bool) -> tuple[
        Outcome, float]:
    """Send one streaming request; returns its outcome and how long to wait before the next (Retry-After)."""
    path, body = request_body(config, rng)
    started = time.perf_counter()
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                raw = await response.aread()
                outcome = Outcome(status=response.status_code, error=raw[:300].decode(errors="replace"))
                if response.status_code in REFUSALS:
                    outcome.refusal_ok = well_formed_refusal(response, raw)
                    wait = float(response.headers.get("retry-after", "1") or 1)
                    return outcome, min(wait, config.max_retry_wait_s) * (0.5 + rng.random())
                return outcome, 0.0
            return await _read_stream(response, started, drop), 0.0
    except httpx.HTTPError as error:
        return Outcome(status=0, error=f"{type(error).__name__}: {error}"), 0.0


async def _read_stream(response: httpx.Response, started: float, drop: bool) -> Outcome:
    outcome = Outcome(status=200)
    finished = False
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            outcome.complete = finished
            break
        event = json.loads(data)
        if "error" in event:
            outcome.error = json.dumps(event["error"])
            continue
        for choice in event.get("choices", []):
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text or choice.get("finish_reason"):
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - started
                outcome.tokens += 1 if text else 0
            finished = finished or bool(choice.get("finish_reason"))
        if drop and outcome.ttft_s is not None:
            outcome.disconnected = True
            return outcome  # leaving the `async with` closes the connection mid-stream
    outcome.e2e_s = time.perf_counter() - started
    return outcome


async def client_loop(http: httpx.AsyncClient, config: LoadConfig, index: int, deadline: float,
                      into: list[Outcome]) -> None:
    rng = random.Random(config.seed * 100_003 + index)
    await asyncio.sleep(rng.random() * 0.5)  # spread the first wave over half a second
    sent = 0
    while time.perf_counter() < deadline:
        sent += 1
        drop = config.disconnect_every > 0 and sent % config.disconnect_every == 0
        outcome, wait = await one_request(http, config, rng, drop)
        into.append(outcome)
        if wait:
            await asyncio.sleep(min(wait, max(deadline - time.perf_counter(), 0)))


def warm_up(url: str, config: LoadConfig, requests: int = 4) -> None:
    """A few requests first, so the RSS baseline includes the allocator's steady state."""
    rng = random.Random(config.seed)
    for _ in range(requests):
        path, body = request_body(config, rng)
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        httpx.post(f"{url}{path}", json={**body, "stream": False}, headers=headers, timeout=config.request_timeout_s)
