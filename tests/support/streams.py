"""A streamed completion run on a thread, for tests that act while a request is in flight (drain, engine death)."""

from __future__ import annotations

import threading

import httpx


def stream_completion(url: str, max_tokens: int, first_event: threading.Event, into: dict) -> None:
    """POST a streamed /v1/completions to the server at `url` (EOS ignored, so it runs max_tokens); set
    `first_event` at the first SSE event; `into` gets "status" and "events" (each `data:` payload, in order)."""
    body = {"prompt": "Tell me a long story about a lighthouse.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        into["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                first_event.set()
    into["events"] = events
