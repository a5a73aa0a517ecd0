"""SITS Triton GPU kernels, each beside the plain-PyTorch reference it is tested against.

Modules (import them directly; this package imports nothing, so CPU-only code never loads Triton):
    attention_prefill  paged_prefill_attention, varlen_prefill_attention   (causal, varlen, GQA, paged)
    attention_decode   paged_decode_attention                              (split-KV, GQA, fp8 cache)
    rope_kv_write      rope_and_cache_write, build_cos_sin_cache           (fused RoPE + cache write)
    rmsnorm            rms_norm (optional fused residual add)
    rmsnorm_quant      rms_norm_quant_fp8                                  (the norm + fp8 per-token quantization)
    silu_mul           silu_mul
    fp8_quantize       quantize_fp8_per_token
    fp8_gemm           fp8_gemm, quantize_weight_fp8_per_channel
    int8_gemm          int8_weight_only_gemm, quantize_weight_int8
    gemm_small_m       small_m_gemm, small_m_gemm_silu_mul                 (bf16 / fp16, decode batches M <= 64)
Triton-free: reference (every reference), rope_tables (cos/sin tables), quantization (weight quantizers),
small_m_table (where small_m_gemm beat cuBLAS, per GPU), device_tables (loading a per-GPU measured table).
"""
