"""The decode attention's merge: each query head's output from its context splits' partial results.

    merge_splits(partial_out, partial_lse, seq_lens, out, plan, launch_options)   the merge kernel's launch
    fused_merge(...)   the same merge inside the split kernel, by the last of a sequence's splits to finish
    merge_partials(...)   what both compute: out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse)

The split kernel (sits.kernels.attention_decode) stores, per (sequence, query head, split), the normalized
partial output [D] float32 and its log-sum-exp (log2 domain); splits that hold no token (`kernel_filled_splits`)
write nothing and are never read. Both merges add the splits in split order, so they give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sits.kernels.decode_splits import DecodeSplitPlan, kernel_filled_splits, kernel_split_tokens
from sits.kernels.last_arrival import last_arrival
from sits.kernels.pdl import pdl_wait

__all__ = ["decode_merge_kernel", "fused_merge", "merge_partials", "merge_splits", "store_group_rows"]


@triton.jit
def merge_partials(po_rows, pl_rows, row_valid, stride_po_split, num_valid,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BYPASS_L1: tl.constexpr):  # fmt: skip
    """Merged outputs [R, HEAD_DIM] float32 of R query heads from their splits' partials.

    po_rows [R] points at each head's partial output of split 0 (split s at + s * stride_po_split,
    HEAD_DIM float32 each), pl_rows [R] at its log-sum-exp of split 0 (split s at + s, log2 domain);
    row_valid [R] masks heads. Splits 0 .. num_valid - 1 count: out = sum_s w_s * o_s / sum_s w_s
    with w_s = 2^(lse_s - max lse); zeros when num_valid is 0 (a padding row).

    The splits are added one after another in split order, element by element (BLOCK_S unrolled,
    masked past num_valid: those add exact zeros), never through a tl.sum, whose order follows the
    register layout and so the kernel's warps. Both callers (the merge kernel, and the split kernel's
    fused merge at any schedule) therefore compute bit-identical outputs. BYPASS_L1 loads with
    .cg (for partials other programs wrote during this launch, see last_arrival)."""
    offs_d = tl.arange(0, HEAD_DIM)
    lse_max = tl.full(po_rows.shape, float("-inf"), dtype=tl.float32)
    for s in tl.static_range(BLOCK_S):  # max is exact in any order
        valid = row_valid & (tl.full(po_rows.shape, s, tl.int32) < num_valid)  # (a vector: the interpreter)
        if BYPASS_L1:
            lse_s = tl.load(pl_rows + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
        else:
            lse_s = tl.load(pl_rows + s, mask=valid, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse_s)
    lse_max = tl.where(row_valid & (num_valid > 0), lse_max, 0.0)  # no inf - inf in empty rows
    acc = tl.zeros([po_rows.shape[0], HEAD_DIM], dtype=tl.float32)
    total = tl.zeros(po_rows.shape, dtype=tl.float32)
    for s in tl.static_range(BLOCK_S):
        valid = row_valid & (tl.full(po_rows.shape, s, tl.int32) < num_valid)  # (a vector: the interpreter)
        rows = po_rows[:, None] + s * stride_po_split + offs_d[None, :]
        if BYPASS_L1:
            lse_s = tl.load(pl_rows + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
            partial = tl.load(rows, mask=valid[:, None], other=0.0, cache_modifier=".cg")
        else:
            lse_s = tl.load(pl_rows + s, mask=valid, other=float("-inf"))
            partial = tl.load(rows, mask=valid[:, None], other=0.0)
        weight = tl.math.exp2(lse_s - lse_max)
        acc = acc + partial * weight[:, None]
        total = total + weight
    return acc / tl.where(total > 0.0, total, 1.0)[:, None]


@triton.jit
def store_group_rows(out_ptr, seq, kv_head, group_size, stride_o_seq, stride_o_head, rows,
                      HEAD_DIM: tl.constexpr, MERGE_G: tl.constexpr):  # fmt: skip
    """rows [MERGE_G, HEAD_DIM] float32 -> out[seq, the KV head's query heads] (rows past the group dropped)."""
    offs_g = tl.arange(0, MERGE_G)
    offs_d = tl.arange(0, HEAD_DIM)
    q_heads = kv_head * group_size + offs_g
    dst = out_ptr + seq * stride_o_seq + q_heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(dst, rows.to(out_ptr.dtype.element_ty), mask=(offs_g < group_size)[:, None])


@triton.jit
def fused_merge(partial_out_ptr, partial_lse_ptr, out_ptr, split_counters_ptr, seq, kv_head, num_valid,
                 group_size, stride_po_seq, stride_po_head, stride_po_split,
                 stride_pl_seq, stride_pl_head, stride_o_seq, stride_o_head,
                 HEAD_DIM: tl.constexpr, MERGE_BLOCK: tl.constexpr, MERGE_G: tl.constexpr):  # fmt: skip
    """After a non-empty split stored its partials: the last of the sequence's num_valid non-empty splits
    (`kernel_filled_splits`) to finish (counted on the int32 counter split_counters[seq * num_kv_heads + kv_head],
    which is 0 before the launch and after it) merges all of them for the KV head's query heads, as
    `decode_merge_kernel` does (`merge_partials`, so bit for bit), and writes out. Empty splits return before
    they get here and never count."""
    counter = split_counters_ptr + seq * tl.num_programs(0) + kv_head
    if last_arrival(counter, num_valid):
        offs_g = tl.arange(0, MERGE_G)
        q_heads = kv_head * group_size + offs_g
        merged = merge_partials(
            partial_out_ptr + seq * stride_po_seq + q_heads * stride_po_head,
            partial_lse_ptr + seq * stride_pl_seq + q_heads * stride_pl_head,
            offs_g < group_size, stride_po_split, num_valid, HEAD_DIM, MERGE_BLOCK, True,
        )  # fmt: skip
        store_group_rows(out_ptr, seq, kv_head, group_size, stride_o_seq, stride_o_head, merged, HEAD_DIM, MERGE_G)


@triton.jit(do_not_specialize=["stride_pl_seq", "stride_pl_head", "min_split_tokens", "num_splits"],
            do_not_specialize_on_alignment=["seq_lens_ptr"])
def decode_merge_kernel(
    partial_out_ptr, partial_lse_ptr, seq_lens_ptr, out_ptr,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_o_seq, stride_o_head,
    min_split_tokens, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """out = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - max lse), over non-empty splits
    (`merge_partials` for one query head per program)."""
    pdl_wait(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_valid = kernel_filled_splits(seq_len, kernel_split_tokens(seq_len, num_splits, min_split_tokens), num_splits)
    row = tl.arange(0, 1)
    merged = merge_partials(
        partial_out_ptr + seq * stride_po_seq + head * stride_po_head + row,
        partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + row,
        row < 1, stride_po_split, num_valid, HEAD_DIM, BLOCK_S, False,
    )  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM)
    dst = out_ptr + seq * stride_o_seq + head * stride_o_head + row[:, None] + offs_d[None, :]
    tl.store(dst, merged.to(out_ptr.dtype.element_ty))


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 plan: DecodeSplitPlan, launch_options: dict) -> None:
    """out [B, Hq, D] from the split kernel's partials: partial_out [B, Hq, S, D] and partial_lse [B, Hq, S]
    float32 (S = plan.num_splits), each sequence's filled splits counted from seq_lens [B] int32 as the split
    kernel filled them (`plan`). launch_options: the launch's PDL keywords (sits.kernels.pdl)."""
    num_seqs, num_q_heads = out.shape[:2]
    decode_merge_kernel[(num_seqs, num_q_heads)](
        partial_out, partial_lse, seq_lens, out,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        plan.min_tokens, plan.num_splits,
        HEAD_DIM=out.shape[2], BLOCK_S=plan.merge_block,
        num_warps=4, **launch_options,
    )  # fmt: skip
