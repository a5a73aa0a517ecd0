"""Turns per-sequence step updates into client-facing `RequestOutput` snapshots.

It owns each completion's text (incremental detokenization and stop strings) and gathers the n
completions of a request into one `RequestOutput`. Every snapshot is a fresh object, so a
consumer on another thread may keep it while the engine goes on.
"""

from __future__ import annotations

import copy
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

    @property
    def finished(self) -> bool:
        return all(c.output.finished for c in self.completions)


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
        metrics: RequestMetrics,
    ) -> None:
        completions = []
        for index in range(params.n):
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            text = TextAccumulator(detokenizer, params.stop, params.include_stop_str_in_output)
            output = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
            completions.append(_CompletionState(text, output))
        self._requests[request_id] = _RequestState(request_id, prompt_token_ids, params, tenant, metrics, completions)

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
        deltas: dict[str, dict[int, CompletionOutput]] = {}
        stopped_by_string: list[str] = []
        for update in updates:
            seq = update.sequence
            state = self._requests.get(seq.request_id)
            if state is None:
                continue
            completion = state.completions[seq.index]
            if completion.output.finished:
                continue
            delta = self._apply(completion, update)
            deltas.setdefault(seq.request_id, {})[seq.index] = delta
            if completion.text.stopped_by is not None and not update.status.finished:
                stopped_by_string.append(seq.seq_id)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            if seq.num_cached_prompt_tokens and seq.index == 0:
                state.metrics.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
        outputs = [self._snapshot(self._requests[rid], step_deltas, now) for rid, step_deltas in deltas.items()]
        return outputs, stopped_by_string

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every unfinished completion with reason ABORT; the final snapshot, or None."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        deltas = {}
        for completion in state.completions:
            if not completion.output.finished:
                completion.output.finish_reason = FinishReason.ABORT
                deltas[completion.output.index] = CompletionOutput(index=completion.output.index)
        return self._snapshot(state, deltas, time.time())

    def _apply(self, completion: _CompletionState, update: SequenceUpdate) -> CompletionOutput:
        """Fold one update into the completion; return this step's delta."""
        seq, output = update.sequence, completion.output
        finished = update.status.finished
        text_tokens = update.new_token_ids[:-1] if update.finished_by_token else update.new_token_ids
        text_delta = completion.text.add_tokens(
            text_tokens, check_stop=seq.num_output_tokens >= seq.params.min_tokens, final=finished
        )
        output.token_ids.extend(update.new_token_ids)
        output.text = completion.text.text
        if update.new_logprobs is not None and output.logprobs is not None:
            output.logprobs.extend(update.new_logprobs)
            output.cumulative_logprob += sum(lp.logprob for lp in update.new_logprobs)
        if completion.text.stopped_by is not None:
            output.finish_reason = FinishReason.STOP
            output.stop_reason = completion.text.stopped_by
        elif finished:
            output.finish_reason = update.status.finish_reason
            output.stop_reason = seq.stop_reason
        return CompletionOutput(
            index=output.index,
            text_delta=text_delta,
            token_ids_delta=list(update.new_token_ids),
            logprobs_delta=list(update.new_logprobs) if update.new_logprobs is not None else None,
        )

    def _snapshot(self, state: _RequestState, deltas: dict[int, CompletionOutput], now: float) -> RequestOutput:
        outputs = []
        for completion in state.completions:
            cumulative = completion.output
            delta = deltas.get(cumulative.index)
            outputs.append(
                CompletionOutput(
                    index=cumulative.index,
                    text=cumulative.text,
                    token_ids=list(cumulative.token_ids),
                    text_delta=delta.text_delta if delta else "",
                    token_ids_delta=delta.token_ids_delta if delta else [],
                    logprobs=list(cumulative.logprobs) if cumulative.logprobs is not None else None,
                    logprobs_delta=_logprobs_delta(cumulative, delta),
                    cumulative_logprob=cumulative.cumulative_logprob,
                    finish_reason=cumulative.finish_reason,
                    stop_reason=cumulative.stop_reason,
                )
            )
        finished = state.finished
        if finished:
            state.metrics.finished_time = now
            del self._requests[state.request_id]
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=copy.copy(state.metrics),
            tenant=state.tenant,
        )


def _logprobs_delta(cumulative: CompletionOutput, delta: CompletionOutput | None) -> list | None:
    if cumulative.logprobs is None:
        return None
    return list(delta.logprobs_delta or []) if delta is not None else []
