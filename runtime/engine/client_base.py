"""What the two `EngineClient`s share: the model's facts, `generate`, and the per-step fan-out.

`AsyncEngine` (the step loop on a thread) and `MultiprocessEngineClient` (the step loop in the
engine process) differ only in how a command reaches the engine and how a step's outputs come
back. Both receive each step's token deltas of every request that advanced in one call on the
event loop (`_fan_out`), which hands them to the requests' `RequestStream`s: the text is decoded
and stop strings applied there, in the same code for both, and a stop string found there is sent
back to the engine as a stop of that completion (`_stop_completions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sits.runtime.engine.client import ModelInfo
from sits.runtime.engine.request import RequestOutput, SamplingParams
from sits.runtime.engine.request_stream import RequestStream

if TYPE_CHECKING:
    from sits.runtime.engine.engine import LLMEngine


@dataclass(frozen=True)
class EngineFacts:
    """What the engine loaded, fixed for its life (the `EngineClient` properties of the same names)."""

    tokenizer: Any  # sits.runtime.models.tokenizer.Tokenizer
    model_name: str
    max_model_len: int  # tokens
    vocab_size: int  # width of the logits
    model_info: ModelInfo

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        config, loaded, lora = engine.config, engine.loaded_model, engine.lora
        info = ModelInfo(source=str(loaded.source), device=str(loaded.device),
                         dtype=str(loaded.dtype).removeprefix("torch."),
                         max_num_seqs=config.scheduler.max_num_seqs,
                         max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                         lora_runtime_updates=lora is not None and config.lora.allow_runtime_updating,
                         lora_num_slots=lora.num_slots if lora is not None else 0)
        return cls(engine.tokenizer, engine.model_name, engine.max_model_len, engine.vocab_size, info)


class StreamingClient:
    """Base of the `EngineClient`s (see the module docstring).

    A subclass calls `_adopt(facts)`, sets `_streams` (request_id -> its stream; touched on the event
    loop) and implements `_submit`, `_release` and `_stop_completions`.
    """

    # The engine's facts (`EngineFacts`), as the `EngineClient` attributes of the same names.
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    model_info: ModelInfo
    _streams: dict[str, RequestStream]
    _healthy: bool
    _accepting: bool  # False once draining or stopped

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self._healthy

    def _adopt(self, facts: EngineFacts) -> None:
        """Take the engine's facts (call first in `__init__`)."""
        vars(self).update({name.name: getattr(facts, name.name) for name in dataclasses.fields(facts)})

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
                       tenant: str = "default", priority: int = 0, cache_salt: str | None = None,
                       stream_text: bool = True, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its snapshots: one per step that changed it while the
        consumer keeps up, the deltas of several steps merged in one when it falls behind.

        Leaving early (break, aclose, cancellation) aborts the request and frees its KV blocks.
        `cache_salt` (the tenant's prefix-cache salt) keeps its cached prefix blocks private.
        `stream_text=False`: only the final snapshot carries text.
        `lora`: the LoRA adapter to run with (a `--lora-modules` name); None: the base model.

        Raises (on iteration):
            PromptTooLongError, InvalidRequestError, SamplingParamsError: bad request (400).
            EngineShuttingDownError: draining or stopped (503).
            EngineDeadError / EngineError: the engine crashed before or while serving it.
        """
        stream = RequestStream(request_id, list(prompt_token_ids), params, tenant, stream_text, self.tokenizer)
        self._submit(stream, priority=priority, cache_salt=cache_salt, lora=lora)
        try:
            while not stream.done:
                yield await stream.next()
        finally:
            self._release(stream, lora)

    def _fan_out(self, outputs: Iterable[RequestOutput]) -> None:
        """On the event loop: one step's token deltas to their streams; stop what a stop string ended."""
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None and (stopped := stream.add(output)):
                self._stop_completions(output.request_id, stopped)

    def _submit(self, stream: RequestStream, *, priority: int, cache_salt: str | None, lora: str | None) -> None:
        """Check the request can be taken, register `stream` and send the request to the engine
        (raises what `generate` documents)."""
        raise NotImplementedError

    def _release(self, stream: RequestStream, lora: str | None) -> None:
        """The consumer left: unregister `stream`; abort the request if it had not finished."""
        raise NotImplementedError

    def _stop_completions(self, request_id: str, indices: list[int]) -> None:
        """Tell the engine that a stop string ended these completions of the request."""
        raise NotImplementedError
