"""Turns one step's logits into tokens, per each sequence's SamplingParams.

Order of operations per row (vLLM's):
  1. logprobs (when asked) from the raw logits: log_softmax of the model's float32 output;
  2. allowed_token_ids and bad_words: the other / banned tokens to -inf (`token_masks.py`);
  3. stop tokens masked while fewer than min_tokens were generated;
  4. logit_bias added (`logit_bias.py`; logprobs above reflect neither it nor 2, as in vLLM);
  5. repetition / presence / frequency penalties;
  6. temperature 0: argmax — exactly `logits.argmax()` on float32 when nothing above applies (on a
     GPU through `sits.kernels.argmax`, which spreads a row over the multiprocessors and returns the
     same index, ties and NaN included);
  7. otherwise: divide by temperature, min_p, top_k, top_p, then draw with the row's generator.
A request with a seed owns a `torch.Generator` seeded with it (completion i of n gets seed + i),
kept on its sequence (`Sequence.generator`, made at its first draw, gone with the sequence), and
its noise is drawn from that generator alone, so the same seed gives the same tokens whatever else
is batched. Requests without a seed share the engine's generator.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from sits.runtime.engine.logit_bias import StepLogitBias
from sits.runtime.engine.request import TokenLogprob
from sits.runtime.engine.sampling_ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    exponential_race,
    token_counts,
)
from sits.runtime.engine.scheduler_output import SampledToken
from sits.runtime.engine.sequence import Sequence as EngineSequence
from sits.runtime.engine.token_masks import StepTokenMask

_TINY = torch.finfo(torch.float32).tiny
logger = logging.getLogger(__name__)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _argmax_on(device: torch.device):
    """torch.argmax(logits, dim=-1) of [N, V] float32 rows: the Triton kernel on CUDA where it is the faster
    (small batches, `kernel_is_faster`; compiled now, not on the first greedy step), torch elsewhere and
    where the kernel cannot be built (logged once)."""
    if device.type != "cuda":
        return _torch_argmax
    try:
        from sits.kernels.argmax import argmax_rows, kernel_is_faster, warm_up

        warm_up(device)
    except Exception as error:  # noqa: BLE001 - a GPU or Triton build the kernel does not support
        logger.warning("greedy sampling uses torch.argmax on %s: the Triton argmax kernel could not be built (%s: %s)",
                       device, type(error).__name__, str(error)[:200])
        return _torch_argmax

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return argmax_rows(logits) if kernel_is_faster(logits) else _torch_argmax(logits)

    return argmax


class Sampler:
    """Samples the next token of each sequence from its logits.

    Args:
        eos_token_ids: masked (with each request's stop_token_ids) until min_tokens.
        device: where logits arrive and generators live.
        seed: seeds the generator shared by requests that give no seed.
    """

    def __init__(self, eos_token_ids: Iterable[int], device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.device = torch.device(device)
        self._shared_generator = torch.Generator(device=self.device)
        self._shared_generator.manual_seed(seed)
        self._argmax = _argmax_on(self.device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, sequences: Sequence[EngineSequence]) -> list[SampledToken]:
        """Pick one token per row and bring the choices to the host (waits for the device).

        Args:
            logits: [N, V] float32, row i for sequences[i].
            sequences: the sequences being sampled (their params and tokens so far); their
                logit_bias, allowed_token_ids and bad_words (as token ids) are gathered here (the
                per-step path passes them to `sample` instead).
        Returns:
            N sampled tokens, with logprobs for rows whose params ask for them.
        """
        return self.sample(logits, sequences, StepLogitBias.of_sequences(sequences, logits.device),
                           StepTokenMask.of_sequences(sequences, logits.device)).to_tokens()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sequences: Sequence[EngineSequence],
               logit_bias: StepLogitBias | None = None, token_mask: StepTokenMask | None = None) -> SamplerOutput:
        """Pick one token per row, leaving the results on the logits' device (nothing waits for it).

        Args and rows as for `__call__`; the caller copies the result to the host when it wants.
        `logit_bias`: the biases of the rows whose requests gave one (the persistent batch keeps
        them, `InputBatch`), None when no row has any; the sequences' own logit_bias is not read.
        `token_mask`: the same for allowed_token_ids and bad_words.
        """
        logits = logits.float()
        # the common case: exactly argmax, no copy of the logits
        if logit_bias is None and token_mask is None and all(map(_plain_greedy, sequences)):
            return SamplerOutput(self._argmax(logits))
        num_rows, vocab_size = logits.shape
        logprob_ks = [-1 if seq.params.logprobs is None else seq.params.logprobs for seq in sequences]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if max(logprob_ks) >= 0 else None
        logits = logits.clone()
        if token_mask is not None:
            token_mask.apply(logits)
        self._mask_stop_tokens(logits, sequences)
        if logit_bias is not None:
            logit_bias.apply(logits)
        self._apply_penalties(logits, sequences)

        greedy = [i for i, seq in enumerate(sequences) if seq.params.greedy]
        random = [i for i, seq in enumerate(sequences) if not seq.params.greedy]
        if not random:
            token_ids = self._argmax(logits)
        elif not greedy:
            token_ids = self._sample_random(logits, sequences)
        else:
            token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            rows = self._to_device(greedy, torch.long)
            token_ids.index_copy_(0, rows, logits.index_select(0, rows).argmax(dim=-1))
            rows = self._to_device(random, torch.long)
            sampled = self._sample_random(logits.index_select(0, rows), [sequences[i] for i in random])
            token_ids.index_copy_(0, rows, sampled)
        if raw_logprobs is None:
            return SamplerOutput(token_ids)
        top_k = max(logprob_ks)
        top_logprobs, top_ids = raw_logprobs.topk(top_k, dim=-1) if top_k > 0 else (None, None)
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(token_ids, logprob_ks, chosen, top_ids, top_logprobs)

    # -- steps -----------------------------------------------------------------------------
    def _mask_stop_tokens(self, logits: torch.Tensor, sequences: Sequence[EngineSequence]) -> None:
        rows, columns = [], []
        for row, seq in enumerate(sequences):
            params = seq.params
            if seq.num_outputs_before_sample >= params.min_tokens:
                continue
            stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
            stop_ids = [t for t in stop_ids if t < logits.shape[1]]
            rows += [row] * len(stop_ids)
            columns += stop_ids
        if rows:
            index = (self._to_device(rows, torch.long), self._to_device(columns, torch.long))
            logits.index_put_(index, logits.new_full((), float("-inf")))

    def _apply_penalties(self, logits: torch.Tensor, sequences: Sequence[EngineSequence]) -> None:
        rows = [
            i
            for i, seq in enumerate(sequences)
            if seq.params.repetition_penalty != 1.0
            or seq.params.presence_penalty != 0.0
            or seq.params.frequency_penalty != 0.0
        ]
        if not rows:
            return
        device, vocab_size = logits.device, logits.shape[1]
        picked = [sequences[i] for i in rows]
        index = self._to_device(rows, torch.long)
        penalized = apply_penalties(
            logits.index_select(0, index),
            token_counts([s.prompt_token_ids for s in picked], vocab_size, device),
            token_counts([s.output_token_ids for s in picked], vocab_size, device),
            self._column([s.params.repetition_penalty for s in picked]),
            self._column([s.params.presence_penalty for s in picked]),
            self._column([s.params.frequency_penalty for s in picked]),
        )
        logits.index_copy_(0, index, penalized)

    def _sample_random(self, logits: torch.Tensor, sequences: Sequence[EngineSequence]) -> torch.Tensor:
        vocab_size = logits.shape[1]
        logits = logits / self._column([s.params.temperature for s in sequences]).unsqueeze(1)
        min_p = [s.params.min_p for s in sequences]
        if any(m > 0 for m in min_p):
            apply_min_p(logits, self._column(min_p))
        top_k = [s.params.top_k if 0 < s.params.top_k < vocab_size else vocab_size for s in sequences]
        top_p = [s.params.top_p for s in sequences]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, self._to_device(top_k, torch.long), self._column(top_p))
        probs = torch.softmax(logits, dim=-1)
        return exponential_race(probs, self._noise(sequences, vocab_size))

    def _noise(self, sequences: Sequence[EngineSequence], vocab_size: int) -> torch.Tensor:
        """[R, V] Exp(1) noise; a seeded row draws only from its own generator."""
        noise = torch.empty(len(sequences), vocab_size, dtype=torch.float32, device=self.device)
        unseeded = [i for i, seq in enumerate(sequences) if seq.params.seed is None]
        if unseeded:
            shared = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=self.device)
            shared.exponential_(generator=self._shared_generator)
            if len(unseeded) == len(sequences):
                return shared.clamp_min_(_TINY)
            noise.index_copy_(0, self._to_device(unseeded, torch.long), shared)
        for row, seq in enumerate(sequences):
            if seq.params.seed is not None:
                noise[row].exponential_(generator=self._generator_for(seq))
        return noise.clamp_min_(_TINY)  # Exp(1) can round to 0; 0/0 would be NaN

    def generator_for(self, seq: EngineSequence) -> torch.Generator:
        """The generator `seq`'s random draws come from: its own when seeded, else the shared one
        (speculative decoding's acceptance tests draw from it too)."""
        return self._generator_for(seq) if seq.params.seed is not None else self._shared_generator

    def _generator_for(self, seq: EngineSequence) -> torch.Generator:
        """The seeded sequence's own generator (`Sequence.generator`), made at its first draw."""
        generator: torch.Generator | None = seq.generator
        if generator is None:
            generator = seq.generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.params.seed)
        return generator

    def _column(self, values: list[float]) -> torch.Tensor:
        return self._to_device(values, torch.float32)

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A small host list on the device without a sync: on CUDA through pinned memory and a
        non-blocking copy (a pageable copy would wait for every queued kernel, which would stall
        async scheduling)."""
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)


def _plain_greedy(seq: EngineSequence) -> bool:
    """Argmax of the raw logits is the whole job: greedy, no logprobs, penalties or stop-token mask."""
    params = seq.params
    return (params.temperature == 0.0 and params.logprobs is None
            and (seq.num_outputs_before_sample >= params.min_tokens
                 or (params.ignore_eos and not params.stop_token_ids))
            and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0)


@dataclass(eq=False)
class SamplerOutput:
    """One step's choices, still on the device: [N] token ids and, when asked, their logprobs.

    Attributes:
        token_ids: [N] int64.
        logprob_ks: per row, -1 (no logprobs) or k >= 0 (the chosen token's logprob and the top k);
            None when no row asked.
        chosen_logprobs: [N] float32 log-softmax of each chosen token (raw logits), or None.
        top_ids, top_logprobs: [N, max k] the best alternatives, best first, or None when max k is 0.
    """

    token_ids: torch.Tensor
    logprob_ks: list[int] | None = None
    chosen_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors to copy to the host, in `from_host` order."""
        return [t for t in (self.token_ids, self.chosen_logprobs, self.top_ids, self.top_logprobs) if t is not None]

    def with_tensors(self, tensors: list[torch.Tensor]) -> SamplerOutput:
        """The same output over other copies of `tensors()` (e.g. host copies), in that order."""
        parts = iter(tensors)
        return SamplerOutput(next(parts), self.logprob_ks,
                             *(next(parts) if t is not None else None
                               for t in (self.chosen_logprobs, self.top_ids, self.top_logprobs)))

    def to_tokens(self) -> list[SampledToken]:
        """Per-row results as Python values (reading device tensors waits for the device)."""
        chosen = self.token_ids.tolist()
        if self.logprob_ks is None:
            return [SampledToken(token_id) for token_id in chosen]
        values = self.chosen_logprobs.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_values = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        tokens = []
        for row, (token_id, k) in enumerate(zip(chosen, self.logprob_ks, strict=True)):
            if k < 0:
                tokens.append(SampledToken(token_id))
                continue
            top = list(zip(top_ids[row][:k], top_values[row][:k], strict=True)) if k else []
            tokens.append(SampledToken(token_id, TokenLogprob(token_id=token_id, logprob=values[row], top=top)))
        return tokens
