"""Turns one step's logits into tokens, per each sequence's SamplingParams.

Order of operations per row (vLLM's):
  1. logprobs (when asked) from the raw logits: log_softmax of the model's float32 output;
  2. stop tokens masked while fewer than min_tokens were generated;
  3. repetition / presence / frequency penalties;
  4. temperature 0: argmax — exactly `logits.argmax()` on float32 when nothing above applies;
  5. otherwise: divide by temperature, min_p, top_k, top_p, then draw with the row's generator.
A request with a seed owns a `torch.Generator` seeded with it (completion i of n gets seed + i),
and its noise is drawn from that generator alone, so the same seed gives the same tokens
whatever else is batched. Requests without a seed share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

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

_TINY = torch.finfo(torch.float32).tiny


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
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, seq_ids: Iterable[str]) -> None:
        """Drop per-sequence generators of finished sequences."""
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, sequences: Sequence[EngineSequence]) -> list[SampledToken]:
        """Pick one token per row.

        Args:
            logits: [N, V] float32, row i for sequences[i].
            sequences: the sequences being sampled (their params and tokens so far).
        Returns:
            N sampled tokens, with logprobs for rows whose params ask for them.
        """
        logits = logits.float()
        num_rows, vocab_size = logits.shape
        want_logprobs = [seq.params.logprobs is not None for seq in sequences]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = logits.clone()
        self._mask_stop_tokens(logits, sequences)
        self._apply_penalties(logits, sequences)

        token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        greedy = [i for i, seq in enumerate(sequences) if seq.params.greedy]
        random = [i for i, seq in enumerate(sequences) if not seq.params.greedy]
        if greedy:
            token_ids[greedy] = logits[greedy].argmax(dim=-1)
        if random:
            token_ids[random] = self._sample_random(logits[random], [sequences[i] for i in random])

        chosen = token_ids.tolist()
        return [
            SampledToken(chosen[i], self._logprob(raw_logprobs, i, chosen[i], seq) if want_logprobs[i] else None)
            for i, seq in enumerate(sequences)
        ]

    # -- steps -----------------------------------------------------------------------------
    def _mask_stop_tokens(self, logits: torch.Tensor, sequences: Sequence[EngineSequence]) -> None:
        for row, seq in enumerate(sequences):
            params = seq.params
            if seq.num_output_tokens >= params.min_tokens:
                continue
            stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
            stop_ids = [t for t in stop_ids if t < logits.shape[1]]
            if stop_ids:
                logits[row, stop_ids] = float("-inf")

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
        penalized = apply_penalties(
            logits[rows],
            token_counts([s.prompt_token_ids for s in picked], vocab_size, device),
            token_counts([s.output_token_ids for s in picked], vocab_size, device),
            self._column([s.params.repetition_penalty for s in picked]),
            self._column([s.params.presence_penalty for s in picked]),
            self._column([s.params.frequency_penalty for s in picked]),
        )
        logits[rows] = penalized

    def _sample_random(self, logits: torch.Tensor, sequences: Sequence[EngineSequence]) -> torch.Tensor:
        vocab_size = logits.shape[1]
        logits = logits / self._column([s.params.temperature for s in sequences]).unsqueeze(1)
        min_p = [s.params.min_p for s in sequences]
        if any(m > 0 for m in min_p):
            apply_min_p(logits, self._column(min_p))
        top_k = [s.params.top_k if 0 < s.params.top_k < vocab_size else vocab_size for s in sequences]
        top_p = [s.params.top_p for s in sequences]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(
                logits, torch.tensor(top_k, dtype=torch.long, device=logits.device), self._column(top_p)
            )
        probs = torch.softmax(logits, dim=-1)
        return exponential_race(probs, self._noise(sequences, vocab_size))

    def _noise(self, sequences: Sequence[EngineSequence], vocab_size: int) -> torch.Tensor:
        """[R, V] Exp(1) noise; a seeded row draws only from its own generator."""
        noise = torch.empty(len(sequences), vocab_size, dtype=torch.float32, device=self.device)
        unseeded = [i for i, seq in enumerate(sequences) if seq.params.seed is None]
        if unseeded:
            shared = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=self.device)
            noise[unseeded] = shared.exponential_(generator=self._shared_generator)
        for row, seq in enumerate(sequences):
            if seq.params.seed is not None:
                noise[row].exponential_(generator=self._generator_for(seq))
        return noise.clamp_min_(_TINY)  # Exp(1) can round to 0; 0/0 would be NaN

    def _generator_for(self, seq: EngineSequence) -> torch.Generator:
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seq.params.seed)
            self._generators[seq.seq_id] = generator
        return generator

    def _logprob(self, raw_logprobs: torch.Tensor, row: int, token_id: int, seq: EngineSequence) -> TokenLogprob:
        row_logprobs = raw_logprobs[row]
        top: list[tuple[int, float]] = []
        k = seq.params.logprobs or 0
        if k > 0:
            values, ids = row_logprobs.topk(k)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(token_id=token_id, logprob=float(row_logprobs[token_id]), top=top)

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)
