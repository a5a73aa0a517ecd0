"""Batched logit transforms used by the sampler: pure tensor functions, one row per sequence.

Every function works row by row in effect (no reduction mixes rows), so a sequence's result does
not depend on which other sequences share its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrence counts of each token id in each row's list.

    The ids travel in one copy (pinned and non-blocking on CUDA, so it does not wait for queued work).
    """
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    rows = [row for row, tokens in enumerate(token_lists) for _ in range(len(tokens))]
    if rows:
        pinned = torch.device(device).type == "cuda"
        host = torch.tensor([rows, [t for tokens in token_lists for t in tokens]], dtype=torch.long, pin_memory=pinned)
        index = host.to(device, non_blocking=True)
        ones = torch.ones(len(rows), dtype=torch.float32, device=device)
        counts.index_put_((index[0], index[1]), ones, accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor,
    output_counts: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalize tokens already seen, in place.

    Repetition (HF / CTRL semantics, over prompt and output tokens): a seen token's logit is
    divided by the penalty when positive and multiplied by it when negative. Presence and
    frequency (OpenAI semantics, over output tokens only): subtract
    `frequency * count + presence * (count > 0)`.

    Args:
        logits: [R, V] float32, changed in place and returned.
        prompt_counts, output_counts: [R, V] float32 from `token_counts`.
        repetition_penalty, presence_penalty, frequency_penalty: [R] float32 (1, 0, 0 = off).
    """
    seen = (prompt_counts > 0) | (output_counts > 0)
    rep = repetition_penalty.unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency_penalty.unsqueeze(1) * output_counts
    logits -= presence_penalty.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the top token's, in place.

    Args:
        logits: [R, V] float32 (temperature already applied).
        min_p: [R] float32 in [0, 1]; 0 keeps everything.
    """
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill_(probs < threshold, NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest set whose probability reaches top_p.

    Ties at the k-th place are broken by token id (a stable sort), so the kept set is
    deterministic.

    Args:
        logits: [R, V] float32 (temperature already applied).
        top_k: [R] int64 in 1..V (V = off).
        top_p: [R] float32 in (0, 1] (1 = off).
    Returns:
        [R, V] with dropped tokens at -inf (a new tensor).
    """
    vocab_size = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), NEG_INF)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # The top token always stays: its mass_before is 0 <= top_p.
    sorted_logits = sorted_logits.masked_fill(mass_before > top_p.unsqueeze(1), NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter_(-1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per row: argmax(probs / E) with E ~ Exp(1) is a categorical draw.

    Args:
        probs: [R, V] float32, rows summing to 1.
        noise: [R, V] float32 Exp(1) samples (from each row's own generator).
    Returns:
        [R] int64 token ids.
    """
    return (probs / noise).argmax(dim=-1)
