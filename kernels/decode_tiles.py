"""One online-softmax step of the decode split kernel over a K / V tile of a paged cache, in each of its loops.

    rows_tile(...)  the query heads as the dots' rows: S = q K^T [G, BLOCK_N], acc += P V
    swap_tile(...)  the tokens as the dots' rows: S^T = K q^T [BLOCK_N, G], acc^T += V^T P^T
    quantize_rows_e4m3(q) -> (hi, lo, row_scale): a query as two e4m3 terms, for the fp8 q8x2 loops

Which loop a launch runs is its VARIANT constexpr (sits.kernels.decode_schedules.FP8_DECODE_VARIANTS); the
kernel that calls these is sits.kernels.attention_decode's. m_i / l_i are in the log2 domain throughout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sits.kernels.paged_kv import paged_tile_blocks

__all__ = ["quantize_rows_e4m3", "rows_tile", "swap_tile"]


@triton.jit
def _round_to_e4m3(x):
    """x (float32) rounded to the nearest e4m3 value, ties to even, for |x| <= 448 (float32 result).

    Done in integer arithmetic so the following cast to e4m3 is exact: Triton's interpreter rounds
    fp32 -> fp8 casts wrongly, the GPU does not. Normal range: 3 mantissa bits; below 2^-6 e4m3's
    subnormal grid of 2^-9 (nearest, ties away from zero: those values are < 1.6e-5 of the maximum)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = tl.where(x < 0, -tl.floor(-x * 512.0 + 0.5), tl.floor(x * 512.0 + 0.5)) * (1.0 / 512.0)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def quantize_rows_e4m3(q):
    """q [G, D] float32 -> (hi, lo, row_scale [G]) with q ~ (hi + lo) * row_scale[:, None], hi and lo
    e4m3: row_scale = max |q_row| / 448 (1 for an all-zero row), hi the e4m3 rounding of the scaled
    row, lo the e4m3 rounding of what hi leaves (hi + lo keep about 7 mantissa bits of q)."""
    amax = tl.max(tl.abs(q), 1)
    row_scale = tl.where(amax > 0.0, amax / 448.0, 1.0)
    scaled = q / row_scale[:, None]
    hi = _round_to_e4m3(scaled)
    lo = _round_to_e4m3(scaled - hi)
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv), row_scale


@triton.jit
def _tile_rows(block_table_row, tile_start, end, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Row offsets of tokens tile_start .. + BLOCK_N in the paged K and V caches, and which lie before `end`."""
    valid = tile_start + tl.arange(0, BLOCK_N) < end
    blocks, slots = paged_tile_blocks(block_table_row, tile_start, end, PAGE_SIZE, BLOCK_N, MASKED)
    return blocks * stride_k_block + slots * stride_k_slot, blocks * stride_v_block + slots * stride_v_slot, valid


@triton.jit
def _tile_load(base, rows, offs_d, valid, TRANSPOSED: tl.constexpr, MASKED: tl.constexpr):
    """One tile of token rows: [BLOCK_N, D], or [D, BLOCK_N] when TRANSPOSED; rows past `end` read as 0 when MASKED."""
    if TRANSPOSED:
        if MASKED:
            tile = tl.load(base + rows[None, :] + offs_d[:, None], mask=valid[None, :], other=0.0)
        else:
            tile = tl.load(base + rows[None, :] + offs_d[:, None])
    else:
        if MASKED:
            tile = tl.load(base + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        else:
            tile = tl.load(base + rows[:, None] + offs_d[None, :])
    return tile


@triton.jit
def rows_tile(acc, m_i, l_i, q, q_low, scale, tile_start, end, block_table_row, k_base, v_base,
               stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
               HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, K_T: tl.constexpr,
               MASKED: tl.constexpr, F32_TERMS: tl.constexpr):  # fmt: skip
    """One online-softmax step over tokens tile_start .. + BLOCK_N with the query heads as the dots'
    rows: acc [G, D], m_i / l_i [G] (log2 domain) in, updated out. MASKED: tokens past `end` excluded
    (else the whole tile must lie before `end`). K_T: K loaded as [D, BLOCK_N]. F32_TERMS (a float32
    query): q and P enter the dots as two terms of the dots' dtype each, S = q K^T + q_low K^T and
    P V = P_hi V + P_lo V (P_lo what P_hi leaves), all summed in float32."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_rows, v_rows, valid = _tile_rows(block_table_row, tile_start, end, stride_k_block, stride_k_slot,
                                       stride_v_block, stride_v_slot, PAGE_SIZE, BLOCK_N, MASKED)
    if K_T:
        k_t = _tile_load(k_base, k_rows, offs_d, valid, True, MASKED).to(q.dtype)
    else:
        k_t = tl.trans(_tile_load(k_base, k_rows, offs_d, valid, False, MASKED).to(q.dtype))
    if F32_TERMS:
        qk = tl.dot(q_low, k_t, tl.dot(q, k_t)) * scale
    else:
        qk = tl.dot(q, k_t) * scale
    if MASKED:
        qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _tile_load(v_base, v_rows, offs_d, valid, False, MASKED)
    if F32_TERMS:
        p_hi = p.to(q.dtype)
        v_dot = v.to(q.dtype)
        acc = tl.dot((p - p_hi.to(tl.float32)).to(q.dtype), v_dot, tl.dot(p_hi, v_dot, acc * alpha[:, None]))
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def swap_tile(acc_t, m_i, l_i, q_t, q_hi_t, q_lo_t, scale, tile_start, end, block_table_row, k_base, v_base,
               stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
               HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
               Q8X2: tl.constexpr, PACKED: tl.constexpr, MASKED: tl.constexpr, F32_TERMS: tl.constexpr):  # fmt: skip
    """rows_tile with the tokens as the dots' rows: S^T = K q^T [BLOCK_N, G], acc_t = out^T [D, G].
    Q8X2: S^T = K (q_hi + q_lo)^T as two fp8 dots, scale [G] per query head (else a scalar).
    PACKED (with Q8X2): one fp8 dot against q_hi_t = [D, 2G] (hi's columns, then lo's), halves summed.
    F32_TERMS (a float32 query): S^T = K q_t + K q_lo_t unless Q8X2, and P as two terms, as in rows_tile."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_rows, v_rows, valid = _tile_rows(block_table_row, tile_start, end, stride_k_block, stride_k_slot,
                                       stride_v_block, stride_v_slot, PAGE_SIZE, BLOCK_N, MASKED)
    k = _tile_load(k_base, k_rows, offs_d, valid, False, MASKED)
    if PACKED:  # K as stored: fp8 x fp8; column j * G + h -> [BLOCK_N, G, 2], summed over j
        s_hi, s_lo = tl.split(tl.permute(tl.reshape(tl.dot(k, q_hi_t), [BLOCK_N, 2, BLOCK_G]), (0, 2, 1)))
        s_t = (s_hi + s_lo) * scale[None, :]
    elif Q8X2:  # K as stored: fp8 x fp8
        s_t = tl.dot(k, q_lo_t, tl.dot(k, q_hi_t)) * scale[None, :]
    elif F32_TERMS:
        k_dot = k.to(q_t.dtype)
        s_t = tl.dot(k_dot, q_lo_t, tl.dot(k_dot, q_t)) * scale
    else:
        s_t = tl.dot(k.to(q_t.dtype), q_t) * scale
    if MASKED:
        s_t = tl.where(valid[:, None], s_t, float("-inf"))  # [BLOCK_N, G]
    m_new = tl.maximum(m_i, tl.max(s_t, 0))
    p_t = tl.math.exp2(s_t - m_new[None, :])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p_t, 0)
    v_t = _tile_load(v_base, v_rows, offs_d, valid, True, MASKED)
    if F32_TERMS:
        p_hi_t = p_t.to(q_t.dtype)
        v_dot = v_t.to(q_t.dtype)
        acc_t = tl.dot(v_dot, (p_t - p_hi_t.to(tl.float32)).to(q_t.dtype), tl.dot(v_dot, p_hi_t, acc_t * alpha[None, :]))
    else:
        acc_t = tl.dot(v_t.to(q_t.dtype), p_t.to(q_t.dtype), acc_t * alpha[None, :])
    return acc_t, m_new, l_i
