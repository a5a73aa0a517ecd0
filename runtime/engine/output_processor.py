"""Turns per-sequence step updates into `RequestOutput` snapshots (the engine's side of a request).

It gathers the n completions of a request into one `RequestOutput` per step. Built with
`detokenize=True` (the default: an offline `LLMEngine`) it also owns each completion's text
(incremental detokenization and stop strings, `completion_state.py`). Built with
`detokenize=False` (the engine serving asyncio clients: the engine process and `AsyncEngine`)
its snapshots carry token deltas only, and the client's `RequestStream` decodes them and applies
stop strings, as vLLM v1 does in its API process; a completion a stop string ended there is
finished here with `stop`. Every snapshot is a fresh object, so a consumer on another thread may
keep it while the engine goes on.

A request that asked for prompt logprobs gathers them chunk by chunk (`add_prompt_logprobs`); its
snapshots wait until the list is complete (deltas of completions that got ahead are held and
merged), so its first snapshot always carries every prompt token's logprob.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from sits.runtime.engine.completion_state import NO_DELTA, Delta, RequestState, TokenStep, merge_deltas
from sits.runtime.engine.detokenizer import SupportsDecode
from sits.runtime.engine.request import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from sits.runtime.engine.scheduler_output import SequenceUpdate


class OutputProcessor:
    """Builds one `RequestOutput` per request and step; with `detokenize`, also its text and stop strings."""

    def __init__(self, tokenizer: SupportsDecode, detokenize: bool = True, cumulative: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize  # False: token deltas only, a client decodes (set before the first request)
        # False: decoded snapshots carry each step's deltas only, no copies of the completions' token ids and
        # text, which grow with every token (a caller reading deltas, such as `sits bench`); set it before
        # the first request.
        self.cumulative = cumulative
        self._requests: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tenant: str,
        metrics: RequestMetrics, stream_text: bool = True,
    ) -> None:
        """Track a request. `stream_text=False`: its text is read only once it finishes, so it is
        decoded then, in one go (unless stop strings need it as it grows), and the snapshots before
        the final one carry token ids but no text; the final one holds the whole text (also as its
        text_delta)."""
        state = RequestState.new(request_id, prompt_token_ids, params, tenant, metrics, stream_text,
                                 self.tokenizer if self.detokenize else None, cumulative=self.cumulative)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self._requests[request_id] = state

    def add_prompt_logprobs(self, chunks: dict[str, tuple[int, list[TokenLogprob]]]) -> None:
        """Append scored prompt tokens: request_id -> (position of the first, their logprobs).

        Positions already held are skipped (a preempted sequence scores its prompt again)."""
        for request_id, (first_position, entries) in chunks.items():
            state = self._requests.get(request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            have = len(state.prompt_logprobs)
            if first_position <= have:
                state.prompt_logprobs.extend(entries[have - first_position:])

    def mark_scheduled(self, request_ids: Iterable[str], now: float) -> None:
        """Stamp first_scheduled_time on requests scheduled for the first time."""
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def process(self, updates: Iterable[SequenceUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's updates.

        Returns:
            (snapshots of the requests that progressed, seq_ids that a stop string finished —
            the caller must finish those in the scheduler).
        """
        now = time.time()
        deltas: dict[str, dict[int, Delta]] = {}
        stopped_by_string: list[str] = []
        for update in updates:
            seq = update.sequence
            state = self._requests.get(seq.request_id)
            if state is None:
                continue
            delta = state.apply(seq.index, _token_step(update))
            if delta is None:
                continue
            deltas.setdefault(seq.request_id, {})[seq.index] = delta
            if state.stopped_by_string(seq.index) is not None and not seq.status.finished:
                stopped_by_string.append(seq.seq_id)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            if seq.num_cached_prompt_tokens and seq.index == 0:
                state.metrics.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
        outputs = []
        for rid, step_deltas in deltas.items():
            state = self._requests[rid]
            if state.prompt_logprobs is not None and not self._release(state, step_deltas):
                continue
            outputs.append(self._snapshot(state, step_deltas, now))
        return outputs, stopped_by_string

    @staticmethod
    def _release(state: RequestState, step_deltas: dict[int, Delta]) -> bool:
        """Whether a request with prompt logprobs may show this step: held deltas are merged in
        front of the step's once its prompt logprobs are complete (or it finished)."""
        if state.prompt_logprobs_pending and not state.finished:
            held = state.held = state.held or {}
            for index, delta in step_deltas.items():
                held[index] = merge_deltas(held[index], delta) if index in held else delta
            return False
        if state.held:
            for index, delta in state.held.items():
                step_deltas[index] = merge_deltas(delta, step_deltas[index]) if index in step_deltas else delta
            state.held = None
        return True

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every unfinished completion with reason ABORT; the final snapshot, or None."""
        return self.end(request_id, range(self._num_completions(request_id)), FinishReason.ABORT)

    def end(self, request_id: str, indices: Iterable[int], reason: FinishReason) -> RequestOutput | None:
        """Finish the completions `indices` of a request as they stand (an abort; a stop string a
        client found). Returns a snapshot of those that ended now, or None if none did; the request's
        final one (`finished`) once no completion runs."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        deltas = {index: NO_DELTA for index in indices
                  if 0 <= index < len(state.completions) and state.end(index, reason)}
        return self._snapshot(state, deltas, time.time()) if deltas else None

    def _num_completions(self, request_id: str) -> int:
        state = self._requests.get(request_id)
        return len(state.completions) if state is not None else 0

    def _snapshot(self, state: RequestState, deltas: dict[int, Delta], now: float) -> RequestOutput:
        output = state.snapshot(deltas, now)
        if output.finished:
            del self._requests[state.request_id]
        return output


def _token_step(update: SequenceUpdate) -> TokenStep:
    seq = update.sequence
    finished = seq.status.finished
    return TokenStep(update.new_token_ids, update.new_logprobs, update.finished_by_token,
                     seq.status.finish_reason if finished else None, seq.stop_reason if finished else None,
                     check_stop=len(seq.output_token_ids) >= seq.params.min_tokens)
