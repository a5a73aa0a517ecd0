"""Turns per-sequence step updates into client-facing `RequestOutput` snapshots.

It owns each completion's text (incremental detokenization and stop strings) and gathers the n
completions of a request into one `RequestOutput`. Every snapshot is a fresh object, so a
consumer on another thread may keep it while the engine goes on.

A request that asked for prompt logprobs gathers them chunk by chunk (`add_prompt_logprobs`); its
snapshots wait until the list is complete (deltas of completions that got ahead are held and
merged), so its first snapshot always carries every prompt token's logprob.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from sits.runtime.engine.detokenizer import IncrementalDetokenizer, SupportsDecode, TextAccumulator
from sits.runtime.engine.request import (
    CompletionOutput,
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from sits.runtime.engine.scheduler_output import SequenceUpdate


@dataclass
class _CompletionState:
    text: TextAccumulator
    output: CompletionOutput  # cumulative fields; deltas are filled per snapshot


@dataclass
class _RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    metrics: RequestMetrics
    completions: list[_CompletionState]
    stream_text: bool
    num_unfinished: int
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None] + one per scored prompt token
    held: dict[int, _Delta] | None = None  # deltas waiting for the prompt logprobs to be complete

    @property
    def prompt_logprobs_pending(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


# One step's delta of one completion: (text, token ids, logprobs or None).
_Delta = tuple[str, list[int], "list[TokenLogprob] | None"]
_NO_DELTA: _Delta = ("", [], None)


class OutputProcessor:
    """Detokenizes, applies stop strings, and builds one `RequestOutput` per request and step."""

    def __init__(self, tokenizer: SupportsDecode) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

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
        completions = []
        for index in range(params.n):
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            text = TextAccumulator(detokenizer, params.stop, params.include_stop_str_in_output, defer=not stream_text)
            output = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
            completions.append(_CompletionState(text, output))
        self._requests[request_id] = _RequestState(request_id, prompt_token_ids, params, tenant, metrics, completions,
                                                   stream_text, params.n,
                                                   [None] if params.prompt_logprobs is not None else None)

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
        deltas: dict[str, dict[int, _Delta]] = {}
        stopped_by_string: list[str] = []
        for update in updates:
            seq = update.sequence
            state = self._requests.get(seq.request_id)
            if state is None:
                continue
            completion = state.completions[seq.index]
            if completion.output.finish_reason is not None:
                continue
            step_deltas = deltas.get(seq.request_id)
            if step_deltas is None:
                step_deltas = deltas[seq.request_id] = {}
            step_deltas[seq.index] = self._apply(state, completion, update)
            if completion.text.stopped_by is not None and not update.sequence.status.finished:
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
    def _release(state: _RequestState, step_deltas: dict[int, _Delta]) -> bool:
        """Whether a request with prompt logprobs may show this step: held deltas are merged in
        front of the step's once its prompt logprobs are complete (or it finished)."""
        if state.prompt_logprobs_pending and not state.finished:
            held = state.held = state.held or {}
            for index, delta in step_deltas.items():
                held[index] = _merge(held[index], delta) if index in held else delta
            return False
        if state.held:
            for index, delta in state.held.items():
                step_deltas[index] = _merge(delta, step_deltas[index]) if index in step_deltas else delta
            state.held = None
        return True

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every unfinished completion with reason ABORT; the final snapshot, or None."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        deltas = {}
        for completion in state.completions:
            if not completion.output.finished:
                completion.output.finish_reason = FinishReason.ABORT
                state.num_unfinished -= 1
                deltas[completion.output.index] = _NO_DELTA
        return self._snapshot(state, deltas, time.time())

    def _apply(self, state: _RequestState, completion: _CompletionState, update: SequenceUpdate) -> _Delta:
        """Fold one update into the completion; return this step's delta."""
        seq, output = update.sequence, completion.output
        finished = seq.status.finished
        new_token_ids = update.new_token_ids
        text_tokens = new_token_ids[:-1] if update.finished_by_token else new_token_ids
        text_delta = completion.text.add_tokens(
            text_tokens, check_stop=len(seq.output_token_ids) >= seq.params.min_tokens, final=finished
        )
        output.token_ids += new_token_ids
        if text_delta:
            output.text += text_delta
        if update.new_logprobs is not None and output.logprobs is not None:
            output.logprobs += update.new_logprobs
            output.cumulative_logprob += sum(lp.logprob for lp in update.new_logprobs)
        if completion.text.stopped_by is not None:
            output.finish_reason = FinishReason.STOP
            output.stop_reason = completion.text.stopped_by
        elif finished:
            output.finish_reason = seq.status.finish_reason
            output.stop_reason = seq.stop_reason
        if output.finish_reason is not None:
            state.num_unfinished -= 1
        logprobs = list(update.new_logprobs) if update.new_logprobs is not None else None
        return text_delta, list(new_token_ids), logprobs

    def _snapshot(self, state: _RequestState, deltas: dict[int, _Delta], now: float) -> RequestOutput:
        finished = state.num_unfinished == 0
        show_text = state.stream_text or finished
        outputs = []
        for completion in state.completions:
            cumulative = completion.output
            text_delta, token_ids_delta, logprobs_delta = deltas.get(cumulative.index, _NO_DELTA)
            if not state.stream_text:  # the whole text arrives with the final snapshot
                text_delta = cumulative.text if finished else ""
            logprobs = None
            if cumulative.logprobs is not None:
                logprobs = list(cumulative.logprobs)
                logprobs_delta = logprobs_delta if logprobs_delta is not None else []
            else:
                logprobs_delta = None
            outputs.append(CompletionOutput(
                index=cumulative.index, text=cumulative.text if show_text else "",
                token_ids=list(cumulative.token_ids), text_delta=text_delta, token_ids_delta=token_ids_delta,
                logprobs=logprobs, logprobs_delta=logprobs_delta, cumulative_logprob=cumulative.cumulative_logprob,
                finish_reason=cumulative.finish_reason, stop_reason=cumulative.stop_reason,
            ))
        if finished:
            state.metrics.finished_time = now
            del self._requests[state.request_id]
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=state.metrics.copy(),
            tenant=state.tenant,
            prompt_logprobs=None if state.prompt_logprobs_pending else state.prompt_logprobs,
        )


def _merge(first: _Delta, then: _Delta) -> _Delta:
    """Two consecutive deltas of one completion as one."""
    logprobs = None if first[2] is None and then[2] is None else [*(first[2] or []), *(then[2] or [])]
    return first[0] + then[0], first[1] + then[1], logprobs
