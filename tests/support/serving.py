"""The real server around a loaded model, as the OpenAI-API tests start it: an engine with a small
KV cache and step budget, uvicorn on a free 127.0.0.1 port, stopped when the block ends."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import openai

from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.engine import LLMEngine
from sits.runtime.lora.config import LoraConfig
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.server.security import ServerSecurity

T = TypeVar("T")


@contextlib.contextmanager
def serve_loaded(loaded: Any, *, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, async_scheduling: bool | None = None,
                 server_config: ServerConfig | None = None,
                 lora: LoraConfig | None = None,
                 security: ServerSecurity | None = None) -> Iterator[tuple[BackgroundServer, AsyncEngine]]:
    """`loaded` (a LoadedModel) served on CPU; yields the running server and its engine (serving the
    LoRA adapters of `lora` too when given; their hooks come off the model when the block ends;
    `security`: the server's security settings, e.g. its --lora-root directories)."""
    model = ModelConfig(device="cpu") if max_model_len is None else ModelConfig(device="cpu", max_model_len=max_model_len)
    config = EngineConfig(model=model, cache=CacheConfig(num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
                          async_scheduling=async_scheduling, lora=lora or LoraConfig())
    engine = AsyncEngine.from_engine(LLMEngine.from_loaded(loaded, config))
    try:
        with BackgroundServer(build_app(engine, server_config or ServerConfig(), security=security)) as server:
            yield server, engine
    finally:
        if engine.engine.lora is not None:
            engine.engine.lora.detach()


def openai_client(server: BackgroundServer) -> openai.OpenAI:
    """The official client pointed at `server`, without retries (a test sees every answer as it is)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def together(*calls: Callable[[], T]) -> list[T]:
    """Run `calls` at once, each on its own thread, so their requests share the server's engine steps (on CPU
    a decode step of SmolLM2 costs about the same for one sequence or a few); their results, in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def beside_a_stream(open_stream: Callable[[], Iterable[Any]], request: Callable[[], T]) -> tuple[T, str]:
    """Run `request` while the completions stream `open_stream()` returns is running, so both share
    engine steps; returns request's result and the stream's text. Asserts the stream was still
    producing after the request finished (else they did not run side by side)."""
    started, last_chunk_at, texts = threading.Event(), [0.0], []

    def consume() -> None:
        for chunk in open_stream():
            started.set()
            texts.append(chunk.choices[0].text if chunk.choices else "")
            last_chunk_at[0] = time.monotonic()

    streaming = threading.Thread(target=consume)
    streaming.start()
    try:
        assert started.wait(60)
        result = request()
        done_at = time.monotonic()
    finally:
        streaming.join(120)
    assert not streaming.is_alive()
    assert last_chunk_at[0] > done_at  # the stream was still running: they shared steps
    return result, "".join(texts)
