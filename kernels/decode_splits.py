"""How a decode attention launch cuts its sequences' contexts into splits (flash-decoding), on the host and in
the kernels alike: one owner of the sizing rule.

    plan_decode_splits(num_seqs, num_kv_heads, max_context, sms[, num_splits]) -> DecodeSplitPlan
    split_tokens(seq_len, num_splits, min_tokens) -> tokens in each split of one sequence
    kernel_split_tokens / kernel_filled_splits: the same two sizes inside a Triton kernel

The host picks how many splits a launch has from the shapes (a CUDA graph's block table spans max_model_len);
each sequence's split length comes from its own seq_len, so a short context under a wide bound still spreads
over as many splits as it fills. The decode split kernel and both merges (sits.kernels.decode_merge) size
every sequence's splits with these functions, so they agree on which splits hold tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sits.kernels.launch_utils import cdiv, length_bucket, next_power_of_2, num_sms, require

__all__ = [
    "GRAPH_BOUND_BASE",
    "GRAPH_BOUND_FACTOR",
    "MAX_SPLITS",
    "MIN_TOKENS_PER_SPLIT",
    "SPLIT_GRANULE",
    "SPLIT_TOKENS_ENV",
    "SPLIT_TOKENS_QUANTUM",
    "DecodeSplitPlan",
    "choose_num_splits",
    "graph_context_bounds",
    "kernel_filled_splits",
    "kernel_split_tokens",
    "min_split_tokens",
    "plan_decode_splits",
    "split_count",
    "split_granule",
    "split_tokens",
]

SPLIT_GRANULE = 128  # tokens; split lengths are multiples of every shipped BLOCK_N (`split_granule`)
_GRANULE = tl.constexpr(SPLIT_GRANULE)  # the same, for the jit functions
MIN_TOKENS_PER_SPLIT = 256
# The least tokens a split keeps, instead of MIN_TOKENS_PER_SPLIT (a multiple of SPLIT_TOKENS_QUANTUM): for A/B
# runs of the split count at small batches (benchmarks/gpu_profile_run.sh's -splitN steps). Under SPLIT_GRANULE
# it is the granule as well, so a 2,048-token context can spread over 32 or 64 splits (more programs per
# multiprocessor, each with fewer tokens; the tiles past a split's end are masked).
SPLIT_TOKENS_ENV = "SITS_DECODE_SPLIT_TOKENS"
SPLIT_TOKENS_QUANTUM = 16  # the smallest tile (BLOCK_N) and the default page: split starts stay on both
MAX_SPLITS = 64


@triton.jit
def kernel_split_tokens(seq_len, num_splits, min_split_tokens):
    """Tokens in each split of a sequence of seq_len tokens over num_splits launched splits: its context cut into
    num_splits pieces rounded up to `split_granule`, at least min_split_tokens each (`split_tokens` on the host).
    Sized from the sequence's own length, not from the launch's bound on it, so a context much shorter than the
    block table's width (a CUDA graph's table spans max_model_len) still spreads over as many splits as it fills."""
    granule = tl.minimum(min_split_tokens, _GRANULE)  # SPLIT_GRANULE unless an A/B run asks for shorter splits
    even = (seq_len + num_splits - 1) // num_splits
    return tl.maximum((even + granule - 1) // granule * granule, min_split_tokens)


@triton.jit
def kernel_filled_splits(seq_len, tokens_per_split, num_splits):
    """How many of the num_splits launched splits a sequence of seq_len tokens fills at tokens_per_split a split
    (`kernel_split_tokens`; never more than launched, the minimum kept as a guard)."""
    return tl.minimum((seq_len + tokens_per_split - 1) // tokens_per_split, num_splits)


def min_split_tokens() -> int:
    """The least tokens a split keeps: SITS_DECODE_SPLIT_TOKENS when set (a positive multiple of
    SPLIT_TOKENS_QUANTUM), else MIN_TOKENS_PER_SPLIT."""
    forced = os.environ.get(SPLIT_TOKENS_ENV, "").strip()
    if not forced:
        return MIN_TOKENS_PER_SPLIT
    require(forced.isdigit() and int(forced) > 0 and int(forced) % SPLIT_TOKENS_QUANTUM == 0,
            f"{SPLIT_TOKENS_ENV} must be a positive multiple of {SPLIT_TOKENS_QUANTUM}, got {forced!r}")
    return int(forced)


def split_granule(min_tokens: int) -> int:
    """What split lengths are rounded up to: SPLIT_GRANULE, or min_tokens where that is shorter (an A/B run's
    SITS_DECODE_SPLIT_TOKENS under 128), so splits start on whole tiles and pages."""
    return min(min_tokens, SPLIT_GRANULE)


def split_count(num_seqs: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """Context splits: none when sequences x KV heads fill the GPU's `sms` multiprocessors, else
    about 4 programs per multiprocessor.

    Each split keeps at least `min_split_tokens()` tokens, so short contexts are not split into
    pieces whose merge costs more than it saves. Non-decreasing in max_context.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= sms:
        return 1  # on an H200, splitting a batch that already fills the GPU only added the merge's cost
    wanted = 4 * sms // programs
    most = max(1, max_context // min_split_tokens())
    return max(1, min(wanted, most, MAX_SPLITS))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """`split_count` on this device's multiprocessors."""
    return split_count(num_seqs, num_kv_heads, max_context, num_sms(device))


@dataclass(frozen=True)
class DecodeSplitPlan:
    """How one launch cuts its contexts, and the compile / autotune keys that follow.

    The launch sizes each sequence's splits from its own length (`split_tokens`, in the kernel): a sequence
    of max_context tokens gets tokens_per_split-token splits, a shorter one shorter splits (at least min_tokens),
    so it spreads over as many of the launched splits as it fills. CUDA graphs launch with max_context = the
    block table's width (max_model_len), however short the contexts they run.

    Attributes:
        requested_splits: the split count asked for (`split_count`, or the caller's num_splits).
        num_splits: splits launched: ceil(max_context / tokens_per_split).
        tokens_per_split: tokens per split of a max_context-token sequence, a multiple of SPLIT_GRANULE (the whole
            context with one split): the most any split of the launch holds.
        min_tokens: the least tokens a split of a sequence holds (`min_split_tokens()` for a chosen count,
            SPLIT_GRANULE for the caller's).
    """

    requested_splits: int
    num_splits: int
    tokens_per_split: int
    min_tokens: int

    @property
    def single(self) -> bool:
        """One split: the split kernel writes the output and no merge runs."""
        return self.num_splits == 1

    def tokens_for(self, seq_len: int) -> int:
        """Tokens in each split of a sequence of seq_len tokens (`split_tokens` over the launched splits)."""
        return split_tokens(seq_len, self.num_splits, self.min_tokens)

    @property
    def split_bucket(self) -> int:
        """The split kernel's autotune bucket (a power of two >= tokens_per_split)."""
        return length_bucket(self.tokens_per_split, cap=1 << 20)

    @property
    def merge_block(self) -> int:
        """The merge kernel's BLOCK_S (a compile-time size), 0 when no merge runs.

        It follows the requested count, which is constant over a range of context lengths, so
        fewer sizes get compiled; splits past num_splits are masked."""
        return 0 if self.single else max(2, next_power_of_2(self.requested_splits))

    @property
    def key(self) -> tuple[bool, int, int]:
        """(single, split_bucket, merge_block): what selects the launch's compiled kernels."""
        return self.single, self.split_bucket, self.merge_block


def plan_decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, sms: int,
                       num_splits: int | None = None) -> DecodeSplitPlan:
    """The split plan of a launch over num_seqs sequences whose contexts are at most max_context
    tokens, on a GPU of `sms` multiprocessors (num_splits: the caller's count, else `split_count`)."""
    requested = split_count(num_seqs, num_kv_heads, max_context, sms) if num_splits is None else int(num_splits)
    require(requested >= 1, f"num_splits must be >= 1, got {num_splits}")
    min_tokens = min_split_tokens() if num_splits is None else SPLIT_GRANULE
    granule = split_granule(min_tokens)
    tokens_per_split = max(granule, cdiv(cdiv(max(max_context, 1), requested), granule) * granule)
    launched = max(1, cdiv(max_context, tokens_per_split))
    if launched == 1:
        tokens_per_split = max(tokens_per_split, max_context)
    return DecodeSplitPlan(requested, launched, tokens_per_split, min_tokens)


def split_tokens(seq_len: int, num_splits: int, min_tokens: int) -> int:
    """Tokens in each split of a sequence of seq_len tokens over num_splits launched splits, as the kernels size
    them (`kernel_split_tokens`): ceil(seq_len / num_splits) rounded up to `split_granule(min_tokens)`, at least
    min_tokens. The sequence fills ceil(seq_len / that) of the splits (none for seq_len 0); the rest return at once."""
    granule = split_granule(min_tokens)
    return max(cdiv(cdiv(seq_len, num_splits), granule) * granule, min_tokens)


# Decode CUDA graphs of a batch size that splits contexts are captured at several context bounds, not only at
# max_model_len: a graph's launch is planned for its bound (the grid, the merge's size and the autotune bucket are
# fixed at capture), and a step replays the graph of the smallest bound that holds its longest context. These are
# the bounds below max_model_len that may get a graph of their own: GRAPH_BOUND_BASE tokens, then each
# GRAPH_BOUND_FACTOR times the one before.
GRAPH_BOUND_BASE = 4096
GRAPH_BOUND_FACTOR = 4


def graph_context_bounds(num_seqs: int, num_kv_heads: int, width: int, sms: int) -> list[int]:
    """The context bounds (tokens, ascending, the last one `width`) at which a decode CUDA graph of num_seqs rows
    is captured, on a GPU of `sms` multiprocessors.

    Only `width` (the graphs' block-table span, max_model_len in whole blocks) when one split serves every context
    at that width: then a bound changes nothing but the autotune bucket. Else also each of GRAPH_BOUND_BASE,
    x GRAPH_BOUND_FACTOR, ... under `width` whose plan (`plan_decode_splits`: splits launched, split bucket, merge
    block) differs from that of the next larger bound kept, so no two of the graphs launch the same attention."""
    def plan_of(bound: int) -> tuple:
        plan = plan_decode_splits(num_seqs, num_kv_heads, bound, sms)
        return plan.num_splits, plan.key

    if plan_decode_splits(num_seqs, num_kv_heads, width, sms).single:
        return [width]
    candidates = []
    bound = GRAPH_BOUND_BASE
    while bound < width:
        candidates.append(bound)
        bound *= GRAPH_BOUND_FACTOR
    kept = [width]
    for bound in reversed(candidates):
        if plan_of(bound) != plan_of(kept[0]):
            kept.insert(0, bound)
    return kept
