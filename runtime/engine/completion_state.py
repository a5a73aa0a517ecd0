"""One request's completions as they grow: tokens, logprobs, text, finish, and the snapshots built of them.

Shared by the two places that follow a request: the engine's `OutputProcessor`, which folds each
step's sampled tokens in, and the client's `RequestStream` (`request_stream.py`), which folds in
what the engine sent. A `RequestState` built with a tokenizer decodes the text and applies stop
strings (`TextAccumulator`); built without one (the engine serving a client that decodes, as the
engine process and `AsyncEngine` do) it only passes token deltas on, and keeps nothing that grows
with the completion.
"""

from __future__ import annotations

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

# One completion's change over one step or more: (text, token ids, logprobs or None).
Delta = tuple[str, list[int], "list[TokenLogprob] | None"]
NO_DELTA: Delta = ("", [], None)


@dataclass(slots=True)
class TokenStep:
    """What one engine step added to one completion.

    Attributes:
        new_token_ids: the tokens appended (more than one with speculative decoding).
        new_logprobs: their logprobs, when the request asked for them.
        finished_by_token: the last token ended the completion (EOS, a stop token id, the end of
            a grammar): its text is not part of the completion.
        finish_reason: why the engine ended the completion with this step; None: it runs on.
        stop_reason: the stop token id that ended it, if one did.
        check_stop: min_tokens is reached: a stop string may end the completion.
    """

    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished_by_token: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    check_stop: bool


@dataclass
class CompletionState:
    """One completion: `output` holds the cumulative fields (text and token ids only when decoding)."""

    text: TextAccumulator | None  # None: tokens are passed on, not decoded
    output: CompletionOutput

    def apply(self, step: TokenStep, keep: bool = True) -> Delta:
        """Fold one step in; return its delta. A stop string found in the text finishes the completion.
        `keep` False: the cumulative token ids, text and logprobs are not kept (no snapshot reads them)."""
        output, text = self.output, self.text
        text_delta = ""
        if text is not None:
            text_tokens = step.new_token_ids[:-1] if step.finished_by_token else step.new_token_ids
            text_delta = text.add_tokens(text_tokens, check_stop=step.check_stop,
                                         final=step.finish_reason is not None)
            if keep:
                output.token_ids += step.new_token_ids
                if text_delta:
                    output.text += text_delta
                if step.new_logprobs is not None and output.logprobs is not None:
                    output.logprobs += step.new_logprobs
        if step.new_logprobs is not None:
            output.cumulative_logprob += sum(lp.logprob for lp in step.new_logprobs)
        if text is not None and text.stopped_by is not None:
            output.finish_reason, output.stop_reason = FinishReason.STOP, text.stopped_by
        elif step.finish_reason is not None:
            output.finish_reason, output.stop_reason = step.finish_reason, step.stop_reason
        logprobs = list(step.new_logprobs) if step.new_logprobs is not None else None
        return text_delta, list(step.new_token_ids), logprobs


@dataclass
class RequestState:
    """One request's n completions and what its snapshots carry.

    `decodes` (a tokenizer was given): cumulative text, token ids and logprobs are kept and every
    snapshot carries all n completions; otherwise snapshots carry only the completions that changed,
    with their deltas (`token_ids`, `text` and `logprobs` left empty). `cumulative=False` gives decoded
    requests the second kind of snapshot too (text deltas, no copy of what grows with the completion: a
    caller that reads deltas only then pays nothing per step for a long completion).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    metrics: RequestMetrics
    completions: list[CompletionState]
    stream_text: bool
    num_unfinished: int
    decodes: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None] + one per scored prompt token
    held: dict[int, Delta] | None = None  # deltas waiting for the prompt logprobs to be complete
    cumulative: bool = True  # False: decoded snapshots carry deltas only, like undecoded ones (no copies)

    @classmethod
    def new(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tenant: str,
            metrics: RequestMetrics, stream_text: bool, tokenizer: SupportsDecode | None,
            cumulative: bool = True) -> RequestState:
        """A request with nothing generated; `tokenizer` None: pass tokens on without decoding;
        `cumulative` False: snapshots with deltas only."""
        completions = []
        for index in range(params.n):
            text = None
            if tokenizer is not None:
                detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                text = TextAccumulator(detokenizer, params.stop, params.include_stop_str_in_output,
                                       defer=not stream_text)
            keeps_logprobs = params.logprobs is not None and tokenizer is not None
            completions.append(CompletionState(text, CompletionOutput(index=index,
                                                                      logprobs=[] if keeps_logprobs else None)))
        return cls(request_id, prompt_token_ids, params, tenant, metrics, completions, stream_text, params.n,
                   tokenizer is not None, cumulative=cumulative)

    @property
    def prompt_logprobs_pending(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def apply(self, index: int, step: TokenStep) -> Delta | None:
        """Fold a step into completion `index`; None when that completion had finished already."""
        completion = self.completions[index]
        if completion.output.finish_reason is not None:
            return None
        delta = completion.apply(step, keep=self.cumulative or not self.stream_text)
        if completion.output.finish_reason is not None:
            self.num_unfinished -= 1
        return delta

    def end(self, index: int, reason: FinishReason, stop_reason: str | int | None = None) -> bool:
        """Finish completion `index` as it stands (abort; a stop string the client found); False if it had ended."""
        output = self.completions[index].output
        if output.finish_reason is not None:
            return False
        output.finish_reason, output.stop_reason = reason, stop_reason
        self.num_unfinished -= 1
        return True

    def stopped_by_string(self, index: int) -> str | None:
        text = self.completions[index].text
        return text.stopped_by if text is not None else None

    def snapshot(self, deltas: dict[int, Delta], now: float) -> RequestOutput:
        """The request now, with `deltas` as the completions' deltas (see the class docstring)."""
        finished = self.finished
        if finished:
            self.metrics.finished_time = now
        whole = self.decodes and self.cumulative
        outputs = [self._completion(c.output, deltas.get(c.output.index, NO_DELTA), finished, whole)
                   for c in self.completions if whole or c.output.index in deltas]
        return RequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids, outputs=outputs,
                             finished=finished, metrics=self.metrics.copy(), tenant=self.tenant,
                             prompt_logprobs=None if self.prompt_logprobs_pending else self.prompt_logprobs)

    def _completion(self, cumulative: CompletionOutput, delta: Delta, finished: bool,
                    whole: bool) -> CompletionOutput:
        """One completion's snapshot: its deltas, and (`whole`) copies of its cumulative token ids, text and
        logprobs."""
        text_delta, token_ids_delta, logprobs_delta = delta
        if not self.stream_text:  # the whole text arrives with the final snapshot (with deltas only: the
            # completion's own last one, since a completion that ended is in no later snapshot)
            done = finished if whole else cumulative.finish_reason is not None
            text_delta = cumulative.text if done else ""
        logprobs = None
        if cumulative.logprobs is not None and whole:
            logprobs = list(cumulative.logprobs)
            logprobs_delta = logprobs_delta if logprobs_delta is not None else []
        elif self.decodes and cumulative.logprobs is None:
            logprobs_delta = None
        text = cumulative.text if whole and (self.stream_text or finished) else ""
        return CompletionOutput(
            index=cumulative.index, text=text,
            token_ids=list(cumulative.token_ids) if whole else [], text_delta=text_delta,
            token_ids_delta=token_ids_delta,
            logprobs=logprobs, logprobs_delta=logprobs_delta, cumulative_logprob=cumulative.cumulative_logprob,
            finish_reason=cumulative.finish_reason, stop_reason=cumulative.stop_reason)


def merge_deltas(first: Delta, then: Delta) -> Delta:
    """Two consecutive deltas of one completion as one."""
    logprobs = None if first[2] is None and then[2] is None else [*(first[2] or []), *(then[2] or [])]
    return first[0] + then[0], first[1] + then[1], logprobs
