"""Plain-PyTorch references for every SITS kernel (no Triton needed, so CPU code may reuse them).

Each Triton kernel is tested against the function here with the same name minus `_reference`.
The references favour clarity over speed: they loop over sequences, upcast to float32 and follow
the HF transformers formulas where a model depends on bit-level agreement (RMSNorm, SiLU·mul).

Paged KV cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence
lives in block block_table[t // block_size] at offset t % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0


# --- attention -------------------------------------------------------------------------------


def gather_paged_kv(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from a paged cache: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    blocks = block_table_row.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def _dequantize(kv: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[L, Hkv, D] cache values to float32, times per-head scales [Hkv] when given."""
    return kv.float() if scale is None else kv.float() * scale.float()[None, :, None]


def _paged_context(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int,
                   k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` keys and values from the paged caches, dequantized to
    float32: ([seq_len, Hkv, D], [seq_len, Hkv, D])."""
    k = _dequantize(gather_paged_kv(k_cache, block_table_row, seq_len), k_scale)
    v = _dequantize(gather_paged_kv(v_cache, block_table_row, seq_len), v_scale)
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D] float32.

    Causal masking is aligned bottom-right: query i sits at position Lk - Lq + i. A query row
    with no visible key (only when Lq > Lk) returns zeros, as FlashAttention does.
    """
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [Hq, Lq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
    if causal:
        query_pos = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        key_pos = torch.arange(k_len, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, vf).transpose(0, 1)


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Attention over a flat variable-length batch: q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D]."""
    out = torch.zeros_like(q)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qe > qs:
            out[qs:qe] = _attend(q[qs:qe], k[ks:ke], v[ks:ke], scale, causal).to(q.dtype)
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens q [T, Hq, D] over their whole context in the paged cache.

    An fp8 cache is dequantized with per-KV-head scales k_scale / v_scale [Hkv] (float32).
    """
    out = torch.zeros_like(q)
    cu_q = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs, qe = cu_q[i], cu_q[i + 1]
        if qe == qs:
            continue
        k, v = _paged_context(k_cache, v_cache, block_tables[i], seq_len, k_scale, v_scale)
        out[qs:qe] = _attend(q[qs:qe], k, v, scale, causal=True).to(q.dtype)
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], over its paged context -> [B, Hq, D].

    Rows with seq_len 0 return zeros. An fp8 cache is dequantized with per-KV-head scales
    k_scale / v_scale [Hkv] (float32).
    """
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = _paged_context(k_cache, v_cache, block_tables[i], seq_len, k_scale, v_scale)
        out[i] = _attend(q[i : i + 1], k, v, scale, causal=False)[0].to(q.dtype)
    return out


# --- RoPE + KV-cache write -------------------------------------------------------------------


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, H, D] over its first rotary_dim dims, computed in float32."""
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    cos = cos_sin_cache[positions.long(), :half][:, None, :]
    sin = cos_sin_cache[positions.long(), half:][:, None, :]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return rotated.to(x.dtype)


def rope_and_cache_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns rotated (q, k) as new tensors and writes rotated k and v into the caches in place.

    An fp8 cache stores k / k_scale and v / v_scale (per KV head, float32) saturated to +-448.
    """
    q_rot = apply_rope_reference(q, positions, cos_sin_cache)
    k_rot = apply_rope_reference(k, positions, cos_sin_cache)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    for cache, values, scale in ((k_cache, k_rot[keep], k_scale), (v_cache, v[keep], v_scale)):
        if scale is not None:
            values = (values.float() / scale.float()[None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        cache[slots // block_size, slots % block_size] = values.to(cache.dtype)
    return q_rot, k_rot


# --- norms and activations ---------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF Llama's RMSNorm, optionally after `residual = x + residual` (rounded to x's dtype).

    The output has x's dtype (HF promotes to the weight's dtype when that is wider).
    """
    if residual is not None:
        residual = x + residual
        x = residual
    hidden = x.float()
    variance = hidden.pow(2).mean(-1, keepdim=True)
    out = (weight * (hidden * torch.rsqrt(variance + eps)).to(x.dtype)).to(x.dtype)
    return out if residual is None else (out, residual)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """HF Llama's MLP activation: silu(gate) * up, gate_up [..., 2F] with the gate first."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- half-precision GEMMs at decode batches ----------------------------------------------------


def small_m_gemm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T with float32 sums -> [M, N] in x's dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


def small_m_gemm_silu_mul_reference(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul_reference of small_m_gemm_reference: x [M, K], w_gate_up [2I, K] (gate rows first) -> [M, I]
    in x's dtype; the product rounded to x's dtype before the activation, as the unfused path stores it."""
    return silu_mul_reference(small_m_gemm_reference(x, w_gate_up))


def small_m_gemm_to_stream_reference(x: torch.Tensor, w: torch.Tensor, stream: torch.Tensor,
                                     group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """stream [M, N] float32 += x [M, K] @ w [N, K]^T (float32 sums, in place) -> (the new stream rounded to x's
    dtype [M, N], its sums of squares over each `group` columns [M, cdiv(N, group)] float32; the default is the
    kernels' gemm_small_m.SUMSQ_GROUP, which tests/kernels/test_gemm_small_m_fold.py checks)."""
    stream += x.float() @ w.float().t()
    m, n = stream.shape
    slots = -(-n // group)
    squares = F.pad(stream * stream, (0, slots * group - n)).view(m, slots, group).sum(-1)
    return stream.to(x.dtype), squares


def row_rstd_reference(sumsq: torch.Tensor, k: int, eps: float) -> torch.Tensor:
    """1 / rms of each row from its sums of squares sumsq [M, slots] over k columns: [M, 1] float32."""
    return torch.rsqrt(sumsq.sum(-1, keepdim=True) / k + eps)


def small_m_gemm_rstd_reference(x: torch.Tensor, w: torch.Tensor, sumsq: torch.Tensor, eps: float) -> torch.Tensor:
    """(x [M, K] @ w [N, K]^T) * row_rstd_reference(sumsq, K, eps), float32 sums -> [M, N] in x's dtype: the
    decoder norm folded into the projection (the norm weight inside w)."""
    return ((x.float() @ w.float().t()) * row_rstd_reference(sumsq, x.shape[-1], eps)).to(x.dtype)


def small_m_gemm_silu_mul_rstd_reference(x: torch.Tensor, w_gate_up: torch.Tensor, sumsq: torch.Tensor,
                                         eps: float) -> torch.Tensor:
    """silu_mul_reference of small_m_gemm_rstd_reference: the products scaled, rounded, then the activation."""
    return silu_mul_reference(small_m_gemm_rstd_reference(x, w_gate_up, sumsq, eps))


# --- quantized GEMMs ------------------------------------------------------------------------


def quantize_fp8_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row e4m3 quantization: x [M, K] -> (x_fp8 [M, K], scale [M, 1] float32)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax * (1.0 / FP8_E4M3_MAX)  # a multiply, as GPU PyTorch divides by a scalar; the kernel matches
    x_fp8 = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return x_fp8, scale


def fp8_gemm_reference(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(a_fp8 [M, K] * a_scale [M, 1]) @ (w_fp8 [N, K] * w_scale [N])^T in float32 -> out_dtype."""
    acc = a_fp8.float() @ w_fp8.float().t()
    return (acc * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)).to(out_dtype)


def fp8_weight_only_gemm_reference(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (w_fp8 [N, K] * w_scale [N])^T with float32 sums -> x's dtype (fp8 weight-only, W8A16)."""
    acc = x.float() @ w_fp8.float().t()
    return (acc * w_scale.float().reshape(1, -1)).to(x.dtype)


def silu_mul_quant_fp8_reference(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul_reference, then quantize_fp8_per_token_reference: gate_up [T, 2F] -> ([T, F] e4m3, [T, 1])."""
    return quantize_fp8_per_token_reference(silu_mul_reference(gate_up))


def dequantize_int8_weight(w_int8: torch.Tensor, scales: torch.Tensor, group_size: int, dtype) -> torch.Tensor:
    """w_int8 [N, K] with scales [N, K // group_size] -> [N, K] in `dtype`."""
    expanded = scales.float().repeat_interleave(group_size, dim=1)
    return (w_int8.float() * expanded).to(dtype)


def int8_weight_only_gemm_reference(
    x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor, group_size: int = 128
) -> torch.Tensor:
    """x [M, K] @ dequantized(w_int8 [N, K])^T, with float32 accumulation -> x's dtype."""
    w = dequantize_int8_weight(w_int8, scales, group_size, x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


def rms_norm_stream_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    stream_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder norm over its residual stream, rounded as sits.kernels.rmsnorm rounds it: x [M, K] (half),
    residual [M, K] or None -> (normed [M, K] in x's dtype, stream [M, K]). stream = residual + x in float32
    rounded to residual's dtype; without residual, x in stream_dtype (x itself when None). normed = the
    stream in float32 times 1 / sqrt(mean of squares + eps), rounded to x's dtype, times the weight, rounded."""
    if residual is not None:
        stream = (residual.float() + x.float()).to(residual.dtype)
    else:
        stream = x if stream_dtype is None else x.to(stream_dtype)
    s = stream.float()
    rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    normed = ((s * rstd).to(x.dtype).float() * norm_weight.float()).to(x.dtype)
    return normed, stream


def small_m_norm_gemm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
    stream_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_stream_reference, then small_m_gemm_reference of the normed rows with w [N, K]:
    (out [M, N] in x's dtype, stream [M, K])."""
    normed, stream = rms_norm_stream_reference(x, residual, norm_weight, eps, stream_dtype)
    return small_m_gemm_reference(normed, w), stream


def small_m_norm_gemm_silu_mul_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    w_gate_up: torch.Tensor, stream_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_stream_reference, then small_m_gemm_silu_mul_reference with w_gate_up [2I, K]:
    (out [M, I] in x's dtype, stream [M, K])."""
    normed, stream = rms_norm_stream_reference(x, residual, norm_weight, eps, stream_dtype)
    return small_m_gemm_silu_mul_reference(normed, w_gate_up), stream


def rms_norm_quant_fp8_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    stream_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm_stream_reference, then quantize_fp8_per_token_reference of the normed rows (in x's dtype):
    x [M, K], residual [M, K] or None -> (normed_fp8 [M, K] e4m3, scale [M, 1] float32, stream [M, K])."""
    normed, stream = rms_norm_stream_reference(x, residual, norm_weight, eps, stream_dtype)
    normed_fp8, scale = quantize_fp8_per_token_reference(normed)
    return normed_fp8, scale, stream
