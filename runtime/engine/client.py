"""`EngineClient`: everything the API server knows of the engine, wherever the engine runs.

Two implementations:
  - `AsyncEngine` (`async_engine.py`): the step loop on a thread of the server's own process;
    `sits generate`, `sits bench`, the tests that build an app around a loaded model, and
    `sits serve --engine-in-process`.
  - `MultiprocessEngineClient` (`core_client.py`): the step loop in a child process
    (`core_process.py`), what `sits serve` runs by default.

The server never reaches into an engine: requests go through `generate` / `abort`, metrics read
the `stats()` snapshot, health reads `is_healthy` / `is_accepting`, the LoRA routes call
`load_lora` / `unload_lora`, and the facts it needs to check requests (tokenizer, context,
vocabulary, a tenant's room in the KV cache, the batch size admission is sized from) are
properties here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sits.runtime.engine.request import RequestOutput, SamplingParams
from sits.runtime.engine.stats import EngineStats
from sits.runtime.lora.config import LoraModule
from sits.runtime.lora.usage import AdapterUsage

if TYPE_CHECKING:
    from sits.runtime.engine.structured_output import GrammarCache
    from sits.runtime.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded and how the engine runs it (for /v1/models and the startup log).

    Attributes:
        source: where the weights came from (a path, `hf://...`, `embedded:<file>`).
        device: e.g. "cpu", "cuda:0".
        dtype: e.g. "float32", "bfloat16".
        max_num_seqs: sequences one step may run (admission control is sized from it).
        max_num_batched_tokens: tokens one step may compute.
        lora_runtime_updates: --enable-lora with --allow-runtime-lora-updating.
        lora_num_slots: adapters that may be served at once (--max-loras; 0 without LoRA).
    """

    source: str
    device: str
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    lora_runtime_updates: bool = False
    lora_num_slots: int = 0


class EngineClient(Protocol):
    """The engine as the server sees it (see the module docstring)."""

    lora_usage: AdapterUsage  # requests in flight per adapter: an adapter in use is never unloaded

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits (token ids at or above it do not exist)."""
        ...

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def lora_modules(self) -> dict[str, LoraModule]:
        """The LoRA adapters served now (name -> module); empty without --enable-lora."""
        ...

    @property
    def is_healthy(self) -> bool:
        """False once the engine crashed or its process died (liveness fails)."""
        ...

    @property
    def is_accepting(self) -> bool:
        """False while shutting down or after a crash (readiness fails)."""
        ...

    def max_tokens_for(self, tenant: str) -> int:
        """The longest sequence `tenant` can hold in the KV cache, in tokens (its shard's room)."""
        ...

    def stats(self) -> EngineStats:
        """The engine's figures, built when asked: after the step in flight, so this may wait for
        that step (never on the event loop's behalf; at most `STATS_WAIT_S`, then the latest figures
        built). Call it off the event loop where a step's wait matters (/metrics does)."""
        ...

    @property
    def grammar_cache(self) -> GrammarCache:
        """Where the server compiles structured-output constraints before a request is admitted
        (`sits.runtime.server.grammar_compiler`: limits, a killable worker, then this cache): the
        engine's own cache in this process, or the server's own one when the engine runs in another."""
        ...

    async def wait_until_dead(self) -> None:
        """Return once the engine can serve no more because it failed (a crashed step, its process
        died); never after an orderly shutdown. The server then exits non-zero."""
        ...

    async def start(self) -> None: ...

    async def shutdown(self, drain_timeout_s: float = 0) -> None:
        """Stop accepting, let in-flight requests finish for up to drain_timeout_s, abort the rest."""
        ...

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
                 tenant: str = "default", priority: int = 0, cache_salt: str | None = None,
                 stream_text: bool = True, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's snapshot after every step that produced tokens; leaving early aborts it.

        Raises (on iteration):
            PromptTooLongError, InvalidRequestError, SamplingParamsError: bad request (400).
            EngineShuttingDownError: draining or stopped (503).
            EngineDeadError / EngineError: the engine crashed before or while serving it (500).
        """
        ...

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests; their streams end with a final snapshot, finish_reason "abort"."""
        ...

    async def load_lora(self, module: LoraModule) -> None:
        """Read the adapter (off the step loop) and write it into a free slot between two steps.

        Raises:
            LoraConfigError: unreadable, does not fit the model, name taken, or no free slot.
        """
        ...

    async def unload_lora(self, name: str) -> None:
        """Zero the adapter's slot between two steps (the caller made sure none of its requests runs)."""
        ...
