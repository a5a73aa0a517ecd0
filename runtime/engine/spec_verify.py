"""Verifying speculative drafts against the target model: which drafts a step keeps.

A speculating row ran [last token, d_1 .. d_k] as one chunk, so the hidden state at the chunk's
offset j (0-based) gives the target's distribution p_{j+1} for the token after d_j's predecessor,
i.e. the distribution d_{j+1} was drafted for; the state after d_k gives the bonus token, which the
ordinary sampler already drew from the row's last position.

Greedy rows keep drafts while each equals the argmax of its position (the token decoding without
speculation would pick), and the first mismatch is replaced by that argmax: token-identical output.
Sampled rows use rejection sampling with a deterministic draft (q = one-hot): d_j is accepted with
probability p_j(d_j), where p_j applies the row's temperature, min_p, top_k and top_p exactly as
the sampler does; on rejection the token is drawn from p_j with d_j removed, renormalized. Every
emitted token is then distributed as p, as without speculation. Rows with anything else shaping
their distribution (penalties, masks, logit_bias, min_tokens) never get drafts (`speculative.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sits.runtime.engine.sampler import Sampler
from sits.runtime.engine.sampling_ops import apply_min_p, apply_top_k_top_p
from sits.runtime.engine.sequence import Sequence as EngineSequence

_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SpecRow:
    """One speculating row of a step.

    Attributes:
        sample_row: the row's index among the step's sampled sequences (and sampled ids).
        flat_start: the flat batch index of the row's first token (its last accepted token).
        draft_token_ids: the k drafts that follow it in the chunk.
    """

    sample_row: int
    flat_start: int
    draft_token_ids: list[int]


def target_probs(logits: torch.Tensor, seq: EngineSequence) -> torch.Tensor:
    """[k, V] the probabilities the sampler draws `seq`'s token from, per row of `logits` [k, V]
    float32 (a random-sampling row: temperature > 0)."""
    params = seq.params
    rows, vocab_size = logits.shape
    logits = logits / params.temperature
    if params.min_p > 0:
        apply_min_p(logits, logits.new_full((rows,), params.min_p))
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    if top_k < vocab_size or params.top_p < 1.0:
        top_k_t = torch.full((rows,), top_k, dtype=torch.long, device=logits.device)
        logits = apply_top_k_top_p(logits, top_k_t, logits.new_full((rows,), params.top_p))
    return torch.softmax(logits, dim=-1)


def accept_drafts(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None
                  ) -> tuple[int, int | None]:
    """Rejection sampling of deterministic drafts against the target's probabilities.

    Args:
        probs: [k, V] float32, row j the target's distribution for draft j.
        drafts: the k draft token ids.
        generator: the row's generator (uniforms for the tests, Exp(1) noise for the residual draw).
    Returns:
        (number of leading drafts accepted, the token drawn from the residual at the first
        rejected position, or None when every draft was accepted).
    """
    k = len(drafts)
    index = torch.tensor(list(drafts), dtype=torch.long, device=probs.device)
    draft_probs = probs.gather(1, index.unsqueeze(1)).squeeze(1)
    uniforms = torch.rand(k, generator=generator, device=probs.device)
    rejected = (uniforms >= draft_probs).tolist()
    num_accepted = rejected.index(True) if True in rejected else k
    if num_accepted == k:
        return k, None
    residual = probs[num_accepted].clone()
    residual[drafts[num_accepted]] = 0.0  # p without the draft; the race below renormalizes
    noise = torch.empty_like(residual).exponential_(generator=generator).clamp_min_(_TINY)
    return num_accepted, int((residual / noise).argmax())


def verify_drafts(hidden: torch.Tensor, spec_rows: Sequence[SpecRow], sequences: Sequence[EngineSequence],
                  compute_logits: Callable[[torch.Tensor], torch.Tensor], sampler: Sampler,
                  sampled_ids: torch.Tensor) -> dict[str, list[int]]:
    """Decide each speculating row's accepted drafts and fix its sampled token in place.

    Args:
        hidden: [num_tokens, H] the step's hidden states (every position).
        spec_rows: the step's speculating rows.
        sequences: the step's sampled sequences (indexed by SpecRow.sample_row).
        compute_logits: the model's head, hidden [N, H] -> logits [N, V] float32.
        sampler: gives each row's generator (its seeded one, or the shared one).
        sampled_ids: [num_sampled] int64, the sampler's tokens from each row's last position (a
            speculating row's bonus token); a row that rejected a draft gets its correction here.
    Returns:
        seq_id -> the drafts accepted (in order), for every speculating row.
    """
    accepted: dict[str, list[int]] = {}
    # every verified position of every row through the head at once (one pass over its weights)
    positions = [row.flat_start + j for row in spec_rows for j in range(len(row.draft_token_ids))]
    index = torch.tensor(positions, dtype=torch.long, device=hidden.device)
    all_logits = compute_logits(hidden.index_select(0, index)).float()
    offset = 0
    for row in spec_rows:
        seq = sequences[row.sample_row]
        drafts = row.draft_token_ids
        logits = all_logits[offset : offset + len(drafts)]
        offset += len(drafts)
        if seq.params.greedy:
            targets = logits.argmax(dim=-1).tolist()
            num_accepted = next((j for j, (t, d) in enumerate(zip(targets, drafts, strict=True)) if t != d),
                                len(drafts))
            correction = targets[num_accepted] if num_accepted < len(drafts) else None
        else:
            num_accepted, correction = accept_drafts(target_probs(logits, seq), drafts, sampler.generator_for(seq))
        accepted[seq.seq_id] = list(drafts[:num_accepted])
        if correction is not None:
            sampled_ids[row.sample_row] = correction
    return accepted
