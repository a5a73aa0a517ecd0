"""Every kernel shape key an engine can ask for, listed from its limits before the first request.

The Triton kernels pick their tile configs per key: prefill attention per bucket of the longest
query chunk (`prefill_len_bucket`), decode attention per split plan (`plan_decode_splits`: one
split or several, the bucket of the tokens per split, the merge kernel's block), the quantized
GEMMs and the small-M direct GEMM per bucket of the row count. The first launch of a new key
benchmarks every config, and compiles them on a fresh machine: seconds during which every stream of
the engine waits.
`tuning_plan` lists the keys an engine with these limits can reach, each with one concrete launch
shape that reaches it (a "witness"), so the start-up pre-tune (`kernel_warmup.py`) can run them all.

    tuning_plan(KernelLimits) -> TuningPlan(prefill, decode, gemm_rows, small_m_rows)

Pure host code: the same bucket functions the kernel launchers call, no device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from sits.kernels.attention_prefill import prefill_len_bucket
from sits.kernels.decode_splits import DecodeSplitPlan, plan_decode_splits, split_count
from sits.kernels.launch_utils import cdiv, length_bucket

GEMM_ROWS_BUCKET_CAP = 1 << 16  # the GEMM launchers' length_bucket(m, cap=1 << 16) of their M_BUCKET
SMALL_M_MAX_ROWS = 64  # the small-M direct GEMM's largest batch (sits.kernels.gemm_small_m.MAX_M)
# A prefill chunk attends to at least this much context in the pre-tune's launches: short chunks
# are mostly the tails of chunked prompts, prefix-cache hits and speculative verifications.
PREFILL_MIN_CONTEXT = 1024


def gemm_rows_bucket(rows: int) -> int:
    """The GEMM kernels' autotune bucket of an [rows, K] activation (fp8_gemm, int8_gemm)."""
    return length_bucket(rows, cap=GEMM_ROWS_BUCKET_CAP)


def int_specialization(value: int) -> int:
    """Triton's compile-time class of an integer argument: 1 (the value 1), 16 (a multiple of 16), else 0."""
    return 1 if value == 1 else 16 if value % 16 == 0 else 0


@dataclass(frozen=True)
class KernelLimits:
    """What bounds a step's shapes.

    Attributes:
        max_num_batched_tokens: new tokens per step (the GEMMs' rows, the prefill chunks' sum).
        max_num_seqs: sequences per step (decode batch size).
        max_model_len: the longest context, in tokens.
        block_size: tokens per KV block.
        num_kv_heads: K/V heads of the cache (this rank's).
        num_sms: the GPU's multiprocessors (the decode split heuristic reads it).
        cache_tokens: tokens the KV cache holds (num_blocks * block_size); keeps witnesses realistic.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_kv_heads: int
    num_sms: int
    cache_tokens: int

    @property
    def context_limit(self) -> int:
        """The longest context a launch may be told about: max_model_len rounded up to whole blocks
        (the CUDA-graph decode batches pass their block tables' whole width)."""
        return cdiv(self.max_model_len, self.block_size) * self.block_size

    @property
    def longest_chunk(self) -> int:
        """The most new tokens one sequence can bring to a step."""
        return min(self.max_num_batched_tokens, self.max_model_len)


@dataclass(frozen=True)
class PrefillShape:
    """One prefill-attention key (`len_bucket`) and a launch that reaches it: num_seqs chunks of
    query_len new tokens, each at the end of a context_len-token context."""

    len_bucket: int
    query_len: int
    num_seqs: int
    context_len: int


@dataclass(frozen=True)
class DecodeShape:
    """One decode-attention key and a launch that reaches it: num_seqs decodes told that their
    contexts are at most max_context tokens (what sets the split plan)."""

    single: bool
    split_bucket: int
    merge_block: int
    num_seqs: int
    max_context: int

    @property
    def key(self) -> tuple[bool, int, int]:
        return self.single, self.split_bucket, self.merge_block


@dataclass(frozen=True)
class TuningPlan:
    """The launches that reach every key (`tuning_plan`).

    Attributes:
        prefill: one shape per prefill bucket, ascending.
        decode: one shape per decode key (single, split bucket, merge block).
        gemm_rows: row counts (M) for the quantized GEMMs: per bucket, the largest M of each
            compile-time class of M (1, a multiple of 16, other) that the bucket holds.
        small_m_rows: row counts for the small-M direct GEMM (sits.kernels.gemm_small_m) and its fused
            norm (sits.kernels.gemm_small_m_norm, buckets up to 8): one per power-of-two bucket up to 64
            that steps reach, its largest reachable M (the kernels do not specialize on M, so one launch
            per bucket tunes and compiles each).
    """

    prefill: tuple[PrefillShape, ...]
    decode: tuple[DecodeShape, ...]
    gemm_rows: tuple[int, ...]
    small_m_rows: tuple[int, ...] = ()


def tuning_plan(limits: KernelLimits) -> TuningPlan:
    """Every prefill, decode and GEMM key that steps within `limits` can reach, each with a launch."""
    return TuningPlan(_prefill_shapes(limits), _decode_shapes(limits), _gemm_rows(limits.max_num_batched_tokens),
                      small_m_rows(limits.max_num_batched_tokens))


def _last_true(lo: int, hi: int, holds: Callable[[int], bool]) -> int:
    """The largest x in [lo, hi] for which `holds`, given holds(lo) and that it holds up to some x only."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _prefill_shapes(limits: KernelLimits) -> tuple[PrefillShape, ...]:
    longest = limits.longest_chunk
    buckets = sorted({prefill_len_bucket(1 << power) for power in range(longest.bit_length())}
                     | {prefill_len_bucket(longest)})
    shapes = []
    for bucket in buckets:

        def within(query_len: int, bucket: int = bucket) -> bool:
            return prefill_len_bucket(query_len) <= bucket

        query_len = _last_true(1, longest, within)
        context_len = min(limits.context_limit, max(query_len, PREFILL_MIN_CONTEXT))
        num_seqs = min(limits.max_num_seqs, limits.max_num_batched_tokens // query_len,
                       limits.cache_tokens // context_len)
        shapes.append(PrefillShape(bucket, query_len, max(1, num_seqs), context_len))
    return tuple(shapes)


def _decode_shapes(limits: KernelLimits) -> tuple[DecodeShape, ...]:
    """Decode batches of every size share a split count at the longest context exactly when they
    split every context alike, so each such group is walked once, over its windows of context
    lengths with one split count (split_count never decreases with the context), bucket by bucket."""
    groups: dict[int, list[int]] = {}
    for num_seqs in range(1, limits.max_num_seqs + 1):
        splits = split_count(num_seqs, limits.num_kv_heads, limits.context_limit, limits.num_sms)
        groups.setdefault(splits, []).append(num_seqs)
    found: dict[tuple[bool, int, int], tuple[int, int]] = {}
    for members in groups.values():
        for max_context in _context_witnesses(members[-1], limits):
            num_seqs = _realistic_batch(members, max_context, limits.cache_tokens)
            key = plan_decode_splits(num_seqs, limits.num_kv_heads, max_context, limits.num_sms).key
            best = found.get(key)
            if best is None or num_seqs * max_context > best[0] * best[1]:
                found[key] = (num_seqs, max_context)
    return tuple(DecodeShape(*key, num_seqs, max_context) for key, (num_seqs, max_context) in sorted(found.items()))


def _context_witnesses(num_seqs: int, limits: KernelLimits) -> list[int]:
    """The longest context of each (split count, split bucket) that num_seqs decodes can have."""

    def plan(max_context: int) -> DecodeSplitPlan:
        return plan_decode_splits(num_seqs, limits.num_kv_heads, max_context, limits.num_sms)

    def same_splits(max_context: int, splits: int) -> bool:
        return plan(max_context).requested_splits == splits

    def within(max_context: int, bucket: int) -> bool:
        return plan(max_context).split_bucket <= bucket

    witnesses = []
    low, limit = 1, limits.context_limit
    while low <= limit:
        splits = plan(low).requested_splits
        high = _last_true(low, limit, functools.partial(same_splits, splits=splits))
        start = low
        while start <= high:  # tokens per split grow with the context inside one split count
            bucket = plan(start).split_bucket
            end = _last_true(start, high, functools.partial(within, bucket=bucket))
            witnesses.append(end)
            start = end + 1
        low = high + 1
    return witnesses


def _realistic_batch(members: list[int], max_context: int, cache_tokens: int) -> int:
    """The largest batch size of `members` whose contexts all fit in the cache, else the smallest."""
    fitting = [n for n in members if n * max_context <= cache_tokens]
    return fitting[-1] if fitting else members[0]


def _gemm_rows(max_rows: int) -> tuple[int, ...]:
    rows: set[int] = set()
    for power in range(max(1, max_rows).bit_length() + 1):
        bucket = 1 << power
        high, low = min(bucket, max_rows), bucket // 2  # the bucket holds (low, high]
        if high <= low or gemm_rows_bucket(high) != bucket:
            continue
        classes: set[int] = set()
        for rows_count in range(high, max(low, high - 32), -1):  # 32 rows hold every class
            if int_specialization(rows_count) not in classes:
                classes.add(int_specialization(rows_count))
                rows.add(rows_count)
    return tuple(sorted(rows))


def small_m_rows(max_rows: int) -> tuple[int, ...]:
    """One row count per bucket (1, 2, 4, ..., SMALL_M_MAX_ROWS) of the small-M GEMM that steps of at most
    max_rows tokens reach: the bucket's largest reachable M."""
    top = min(max(max_rows, 0), SMALL_M_MAX_ROWS)
    powers = range(SMALL_M_MAX_ROWS.bit_length())
    return tuple(min(1 << power, top) for power in powers if (1 << power) // 2 < top)
