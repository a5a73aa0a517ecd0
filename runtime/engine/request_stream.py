"""`RequestStream`: one request's outputs on the client's side of the engine, text included.

The engine serving asyncio clients (the engine process, `AsyncEngine`) sends each step's token
deltas only (`OutputProcessor(detokenize=False)`): token ids, logprobs, and the finish reasons the
engine decides (EOS, stop token ids, max_tokens, the end of a grammar, abort). Here, in the
client's process and on its event loop, each request's stream decodes the text incrementally and
applies its stop strings (held-back text, `include_stop_str_in_output`, the bounded scan of
`detokenizer.py`), exactly as the engine's own `OutputProcessor` does offline (the same
`RequestState` code), step by step. When a stop string ends a completion the stream finishes it
for the consumer at once and `add` returns its index, so the caller tells the engine to stop that
sequence (`LLMEngine.stop_completions`) and its blocks are freed; the other completions of an
n > 1 request go on.

A consumer that falls behind is not sent one snapshot per step: the deltas that arrive meanwhile
are merged, and `next` returns one snapshot carrying all of them (vLLM's RequestOutputCollector).
A consumer that keeps up gets every step as it comes, so latency is unchanged, and the snapshot (a
copy of the cumulative fields) is only built when the consumer asks for it.
"""

from __future__ import annotations

import asyncio
import time

from sits.runtime.engine.completion_state import NO_DELTA, Delta, RequestState, TokenStep, merge_deltas
from sits.runtime.engine.detokenizer import SupportsDecode
from sits.runtime.engine.request import FinishReason, RequestMetrics, RequestOutput, SamplingParams


class RequestStream:
    """One request's outputs, decoded and waiting for their consumer (see the module docstring).

    Args:
        request_id, prompt_token_ids, params, tenant, stream_text: as given to the engine.
        tokenizer: the engine's tokenizer (decodes the text here).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tenant: str,
                 stream_text: bool, tokenizer: SupportsDecode) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tenant = tenant
        self.stream_text = stream_text
        self._state = RequestState.new(request_id, prompt_token_ids, params, tenant, RequestMetrics(), stream_text,
                                       tokenizer)
        self._min_tokens = params.min_tokens
        self._pending: dict[int, Delta] | None = None  # merged deltas the consumer has not read
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None  # the consumer waiting in `next`
        self.received = False  # the engine sent an output for this request
        self.done = False  # the consumer got the final snapshot, or the error

    def add(self, output: RequestOutput) -> list[int]:
        """Fold in one engine step of this request (token deltas, `OutputProcessor(detokenize=False)`).

        Returns:
            the indices of the completions a stop string ended with this step (for the engine to stop).
        """
        state = self._state
        self.received = True
        state.metrics = output.metrics
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = output.prompt_logprobs
        stopped = []
        for completion in output.outputs:
            index, reason = completion.index, completion.finish_reason
            if reason is FinishReason.ABORT and not completion.token_ids_delta:
                if state.end(index, reason):
                    self._queue(index, NO_DELTA)
                continue
            generated = len(state.completions[index].output.token_ids) + len(completion.token_ids_delta)
            step = TokenStep(completion.token_ids_delta, completion.logprobs_delta,
                             finished_by_token=reason is FinishReason.STOP, finish_reason=reason,
                             stop_reason=completion.stop_reason, check_stop=generated >= self._min_tokens)
            delta = state.apply(index, step)
            if delta is None:
                continue
            self._queue(index, delta)
            if reason is None and state.stopped_by_string(index) is not None:
                stopped.append(index)
        return stopped

    def abort(self) -> None:
        """End every unfinished completion with finish_reason "abort" (the engine cannot finish them)."""
        for index in range(len(self._state.completions)):
            if self._state.end(index, FinishReason.ABORT):
                self._queue(index, NO_DELTA)

    def fail(self, error: BaseException) -> None:
        """End the stream with `error`, raised to the consumer after the outputs it has not read."""
        if self._error is None:
            self._error = error
            self._wake()

    async def next(self) -> RequestOutput:
        """The request now, with every delta since the last call; waits for one. Raises the stream's error."""
        while self._pending is None:
            if self._error is not None:
                self.done = True
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        deltas, self._pending = self._pending, None
        output = self._state.snapshot(deltas, time.time())
        self.done = output.finished
        return output

    def _queue(self, index: int, delta: Delta) -> None:
        pending = self._pending
        if pending is None:
            self._pending = {index: delta}
            self._wake()
        else:
            pending[index] = merge_deltas(pending[index], delta) if index in pending else delta

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
