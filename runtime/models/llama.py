"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) as plain `nn.Module` code.

The model works on a flat batch: the new tokens of every scheduled sequence, concatenated
([num_tokens]), with their absolute positions. Attention goes through an `AttentionBackend`,
which writes K/V into the paged cache and reads each sequence's context through its block table;
the batch layout arrives explicitly in `AttentionMetadata`.

Q/K/V and gate/up projections are fused into one matrix each (one GEMM instead of three / two);
`load_weights` accepts HF tensor names and copies each into its slice; `export_weights` gives them back.
RMSNorm and SiLU·mul go through the `KernelOps` the attention back end brings (plain PyTorch by
default, fused Triton kernels with the Triton back end), so the model has no device branches. The four
projections are `DecodeLinear` (nn.Linear unless a measured table moves decode batches to the small-M
direct GEMM, see small_m_linear.py).
The layers carry the residual stream beside their output (vLLM's layout): every residual add is fused
into the norm that follows it, so a layer launches two norm kernels and no separate add. At the smallest
decode batches a measured table may fuse each of those norms into the projection it feeds as well (one
launch for norm + qkv_proj, one for norm + gate_up_proj + SiLU·mul; `RMSNorm.fuses_into`). With fp8 w8a8
projections the norms before qkv_proj and gate_up_proj write their rows already quantized per token (e4m3 and
a scale: `RMSNorm.quantizes_for`), so those projections launch no quantization of their own.
At the decode buckets where the small-M table runs every projection on a Triton kernel, the norms are folded
into the projections instead (norm_fold.py, `LlamaForCausalLM.forward_folded`): no norm launch inside a layer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from sits.kernels.small_m_table import MAX_M, m_bucket
from sits.runtime.attention.backend import AttentionBackend, AttentionMetadata
from sits.runtime.engine.kv_cache_fp8 import scale_kwargs
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.kernel_ops import TORCH_OPS, KernelOps, logits_float32
from sits.runtime.models.rotary import build_cos_sin_cache
from sits.runtime.models.small_m_linear import DecodeLinear

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as HF Llama does).

    Attributes:
        out_dtype: the normalized row's dtype; None: the weight's (the model's). float32 with
            --activation-dtype float32 (`LlamaForCausalLM.use_activation_dtype`): the row is not rounded.
    """

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps = TORCH_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops
        self.out_dtype: torch.dtype | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, stream_dtype: torch.dtype | None = None
    ):
        """x: [num_tokens, hidden_size] → same shape in `out_dtype` (None: the weight's, the model's).

        With `residual` (the stream, handed over: it may be updated in place), returns
        (norm(x + residual), x + residual): the add fused into the norm, the sum in residual's dtype
        (float32 in a half-precision model). Without it but with `stream_dtype`, starts the stream:
        (norm(stream), stream) with stream = x.to(stream_dtype), the cast fused into the norm.
        """
        if residual is not None:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.out_dtype)
        if stream_dtype is not None:
            return self.ops.stream_rms_norm(x, self.weight, self.eps, stream_dtype, self.out_dtype)
        return self.ops.rms_norm(x, self.weight, self.eps, self.out_dtype)

    def fuses_into(self, linear: nn.Module, x: torch.Tensor, silu_mul: bool = False) -> bool:
        """Whether this norm of x and `linear` (the projection it feeds; silu_mul: gate_up + SiLU·mul) run as
        one launch: the norm is the Triton kernel and `linear` a DecodeLinear whose measured table says the
        fused form wins at x's rows (host-side, from shapes only). The torch back end never fuses, nor does
        a norm whose row stays float32 (out_dtype)."""
        return (self.ops.name == "triton" and self.out_dtype is None and isinstance(linear, DecodeLinear)
                and linear.fuses_norm(x, self.weight, silu_mul))

    def quantizes_for(self, consumer: nn.Module, x: torch.Tensor) -> bool:
        """Whether this norm of x writes its row already quantized for `consumer` (`quantized`, then the
        consumer's forward_quantized / forward_quantized_input): the norm is the Triton one and not compiled
        (--compile keeps its path), x is [num_tokens, hidden] in the weight's dtype, and the consumer (an fp8
        w8a8 Fp8Linear or Fp8SwiGLU) accepts quantized input. Host-side, from types and shapes only."""
        accepts = getattr(consumer, "accepts_quantized_input", None)
        return (self.ops.name == "triton" and self._compiled_call_impl is None and x.dim() == 2
                and x.dtype == self.weight.dtype and callable(accepts) and bool(accepts()))

    def quantized(self, x: torch.Tensor, residual: torch.Tensor | None, stream_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`self(x, residual, stream_dtype)` with its normed row quantized per token to e4m3 for an fp8 w8a8 GEMM,
        in the norm's launch (see `quantizes_for`): (normed_fp8 [num_tokens, hidden] float8_e4m3fn,
        scale [num_tokens, 1] float32, stream). residual is handed over as in forward; without it x starts the
        stream in stream_dtype (x's own when None)."""
        return self.ops.rms_norm_quant_fp8(x, residual, self.weight, self.eps, stream_dtype or x.dtype)

    def fused_linear(self, linear: DecodeLinear, x: torch.Tensor, residual: torch.Tensor | None,
                     stream_dtype: torch.dtype | None = None, silu_mul: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`linear(self(x, residual, stream_dtype)[0])` (silu_mul: its SiLU·mul) and the new stream, in one
        launch (see `fuses_into`): (out [num_tokens, out], stream). With residual the stream is x + residual
        (a new tensor), else x in stream_dtype (x itself in its own dtype)."""
        return linear.norm_linear(x, residual, self.weight, self.eps, None if residual is not None else stream_dtype,
                                  silu_mul)


class LMHead(nn.Linear):
    """The output head: hidden [N, hidden_size] → logits [N, vocab_size] float32, never rounded to the
    model dtype on the way (see `logits_float32`: half-precision logits tie, and greedy picks change)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return logits_float32(hidden, self.weight)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: LlamaConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.qkv_proj = DecodeLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = DecodeLinear(self.q_size, config.hidden_size, bias=config.o_proj_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] → [num_tokens, hidden_size]."""
        return self.o_proj(self.attend_heads(self.qkv_proj(hidden), positions, cos_sin_cache, kv_cache, metadata))

    def attend_heads(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The rest of `forward` after qkv_proj but o_proj: RoPE, the KV-cache write and attention, qkv
        [num_tokens, q_size + 2 kv_size] → the heads' outputs [num_tokens, q_size], o_proj's input."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        scales = scale_kwargs(kv_cache)  # an fp8 cache's per-head k_scale / v_scale, else none
        # RoPE, the KV-cache write and attention: the back end may fuse them (Triton's decode rows do)
        out = self.backend.rope_write_attend(q, k, v, positions, cos_sin_cache, k_cache, v_cache, metadata,
                                             self.scale, **scales)
        return out.reshape(num_tokens, self.q_size)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, ops: KernelOps = TORCH_OPS) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = DecodeLinear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias,
                                         gated=True)
        self.down_proj = DecodeLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if isinstance(gate_up, DecodeLinear) and gate_up.fuses_silu_mul(x):  # GEMM and SiLU·mul in one launch
            return self.down_proj(gate_up.silu_mul(x))
        return self.down_proj(self.ops.silu_mul(gate_up(x)))


class LlamaDecoderLayer(nn.Module):
    """Attention and MLP sublayers over a carried residual stream (vLLM's layout).

    A layer does not add its MLP's output to the stream: it returns it, and the next norm (the next
    layer's input_layernorm, or the model's final norm) adds it as part of its fused add + norm. So a
    layer runs two fused norm kernels and no separate add; at the batches where the measured small-M
    table says so, each of those norms runs inside the launch of the projection it feeds instead
    (`RMSNorm.fuses_into`: the Triton norm, a DecodeLinear, no hook), and the layer has no norm launch. With
    fp8 w8a8 projections each norm writes its row quantized for the projection it feeds instead
    (`RMSNorm.quantizes_for`), and qkv_proj and the MLP's gate_up launch no quantization of their own.
    """

    def __init__(self, config: LlamaConfig, backend: AttentionBackend, ops: KernelOps = TORCH_OPS) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = LlamaMLP(config, ops)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        stream_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over the flat batch.

        Args:
            hidden: [num_tokens, hidden_size] model dtype: the previous layer's MLP output, not yet in the
                stream; for the first layer (residual None) the embedding rows, the stream's start.
            residual: [num_tokens, hidden_size] the residual stream (its dtype is kept), handed over (it may
                be updated in place); None for the first layer.
            stream_dtype: the stream's dtype when the first layer starts it (None: hidden's dtype).
        Returns:
            (mlp_out, residual): this layer's MLP output [num_tokens, hidden_size] in the model dtype, and
            the stream with the previous MLP output and this attention output added (not the MLP's: the
            next norm adds it).
        """
        attn, norm, mlp = self.self_attn, self.input_layernorm, self.mlp
        if norm.fuses_into(attn.qkv_proj, hidden):  # the norm and qkv_proj in one launch
            qkv, residual = norm.fused_linear(attn.qkv_proj, hidden, residual, stream_dtype or hidden.dtype)
            attention = attn.o_proj(attn.attend_heads(qkv, positions, cos_sin_cache, kv_cache, metadata))
        elif norm.quantizes_for(attn.qkv_proj, hidden):  # fp8 w8a8: the norm quantizes qkv_proj's input
            normed_fp8, scale, residual = norm.quantized(hidden, residual, stream_dtype)
            qkv = attn.qkv_proj.forward_quantized(normed_fp8, scale, norm.weight.dtype)
            attention = attn.o_proj(attn.attend_heads(qkv, positions, cos_sin_cache, kv_cache, metadata))
        else:
            if residual is None:
                normed, residual = norm(hidden, stream_dtype=stream_dtype or hidden.dtype)
            else:
                normed, residual = norm(hidden, residual)  # residual += previous MLP output
            attention = attn(normed, positions, cos_sin_cache, kv_cache, metadata)
        norm = self.post_attention_layernorm
        if isinstance(mlp, LlamaMLP) and norm.fuses_into(mlp.gate_up_proj, attention, silu_mul=True):
            activated, residual = norm.fused_linear(mlp.gate_up_proj, attention, residual, silu_mul=True)
            return mlp.down_proj(activated), residual  # the norm, gate_up and SiLU·mul in one launch
        if norm.quantizes_for(mlp, attention):  # fp8 w8a8 (Fp8SwiGLU): the norm quantizes gate_up's input
            normed_fp8, scale, residual = norm.quantized(attention, residual)
            return mlp.forward_quantized_input(normed_fp8, scale, norm.weight.dtype), residual
        normed, residual = norm(attention, residual)  # residual += attention
        return mlp(normed), residual

    def forward_folded(
        self,
        x: torch.Tensor,
        sumsq: torch.Tensor | None,
        stream: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of a decode step with its norms folded into the projections (runtime/models/norm_fold.py).

        Args:
            x: [num_tokens, hidden_size] model dtype: the stream rounded to it, as the previous layer's down_proj
                wrote it; for the first layer (sumsq None) the input norm's output.
            sumsq: [num_tokens, cdiv(hidden_size, 32)] float32, the stream's sums of squares, or None.
            stream: [num_tokens, hidden_size] float32, the residual stream, updated in place (this layer's
                attention and MLP outputs added).
        Returns:
            (x, sumsq) for the next layer (or, after the last, the stream's rounded copy and sums).
        """
        attn, mlp = self.self_attn, self.mlp
        qkv = attn.qkv_proj(x) if sumsq is None else attn.qkv_proj.scaled(x, sumsq, self.input_layernorm.eps)
        heads = attn.attend_heads(qkv, positions, cos_sin_cache, kv_cache, metadata)
        x, sumsq = attn.o_proj.to_stream(heads, stream)
        fused = getattr(mlp, "fused_decode", None)  # SITS_FUSED_MLP (runtime/models/fused_mlp.py)
        if fused is not None and fused.takes(x):
            return fused(mlp, x, sumsq, self.post_attention_layernorm.eps, stream)
        activated = mlp.gate_up_proj.scaled_silu_mul(x, sumsq, self.post_attention_layernorm.eps)
        return mlp.down_proj.to_stream(activated, stream)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, backend: AttentionBackend, ops: KernelOps = TORCH_OPS) -> None:
        super().__init__()
        # Given an empty weight, nn.Embedding skips its random init: the checkpoint (or
        # build_random_model) fills it, and on the meta device normal_() costs seconds of imports.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, ops) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its output head.

    Args:
        config: the model's shape.
        backend: the attention back end every layer calls.
        max_positions: rows of the RoPE table; defaults to config.max_position_embeddings.
    Attributes:
        residual_dtype: the residual stream's dtype between the sublayers (None: the model dtype).
            float32 by default: a bfloat16 stream rounds every layer's two sums to 8 bits of mantissa,
            the largest single share of bf16's drift from float32 on real weights (benchmarks/RESULTS.md,
            "Which bf16 activation roundings"). It costs 4 instead of 2 bytes x hidden_size per token of
            the stream (at prefill: 128 MiB instead of 64 for 8,192 tokens of Llama-3-8B, and the fused
            add + norm moves 12 bytes an element instead of 8; at decode nothing beside the weights).
            GEMMs, the KV cache, attention and collectives keep the model dtype. No-op in float32.
        activation_dtype: the dtype of every activation between the kernels (None: the model dtype). float32
            in a half-precision model with --activation-dtype float32 (`use_activation_dtype`).
        fold_buckets: the M buckets (row counts up to 64) whose steps run with the decoder norms folded into the
            projections (`forward_folded`; set at start-up by norm_fold.fold_decoder_norms; empty: none).
    """

    residual_dtype: torch.dtype | None = torch.float32
    activation_dtype: torch.dtype | None = None
    fold_buckets: frozenset[int] = frozenset()

    def __init__(self, config: LlamaConfig, backend: AttentionBackend, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, backend, backend.kernel_ops())
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions or config.max_position_embeddings
        # [max_positions, head_dim] float32. Not a parameter and not saved: rebuilt from the config.
        self.register_buffer("cos_sin_cache", self._rope_table(), persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(dtype) must not cast the RoPE table (it stays float32), and .to_empty() after building
        # on the meta device must refill it rather than leave it uninitialised.
        before = self.cos_sin_cache
        result = super()._apply(fn, recurse)
        after = self.cos_sin_cache
        if after.device.type == "meta":
            self.cos_sin_cache = before.to("meta")
        elif before.device.type == "meta":
            self.cos_sin_cache = self._rope_table(after.device)
        elif after.dtype != torch.float32:
            self.cos_sin_cache = before.to(after.device)
        if self.config.tie_word_embeddings:  # conversions that swap parameters (to_empty) untie them
            self.lm_head.weight = self.model.embed_tokens.weight
        return result

    def use_activation_dtype(self, dtype: torch.dtype | None) -> None:
        """Run the activations in `dtype` (None: the model dtype) beside the weights' dtype.

        float32 in a bfloat16 / float16 model (--activation-dtype float32): every norm writes its row in
        float32 unrounded, so the projections get float32 inputs and multiply them in two half-precision
        parts (`mixed_linear`, or the small-M kernels at their decode buckets) with float32 outputs; q, k and v,
        attention's output and SiLU·mul's stay float32, and only the KV cache (and the weights) keep the model
        dtype. The residual stream is float32 already (`residual_dtype`). Greedy choices then follow a float32
        model's closely (RESULTS.md)."""
        self.activation_dtype = None if dtype == self.model.embed_tokens.weight.dtype else dtype
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.out_dtype = self.activation_dtype

    def _rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        c = self.config
        return build_cos_sin_cache(c.head_dim, self.max_positions, c.rope_theta, c.rope_scaling, device=device)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's k_cache and v_cache: [num_blocks, block_size, num_kv_heads, head_dim]."""
        attention = self.model.layers[0].self_attn  # its own heads: a tensor-parallel shard holds a share
        return (num_blocks, block_size, attention.num_kv_heads, attention.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the decoder over one flat batch.

        Args:
            input_ids: [num_tokens] int64.
            positions: [num_tokens] int64, absolute positions (< max_positions).
            kv_caches: one (k_cache, v_cache) per layer, each [num_blocks, block_size, kv_heads, head_dim].
            metadata: the step's batch layout.
        Returns:
            [num_tokens, hidden_size] final hidden states (after the last norm), in the model dtype.

        The residual stream starts as the embedding rows in `residual_dtype` (the cast fused into the
        first layer's input norm) and is carried from layer to layer; every add is fused into the norm
        that follows it, the last MLP's into the final norm: 2 norm kernels per layer + 1, no other
        element-wise kernel outside attention and the MLP. A step of at most 64 rows in `fold_buckets` runs
        `forward_folded` instead (two norm kernels in all).
        """
        if self.fold_buckets and input_ids.shape[0] <= MAX_M and m_bucket(input_ids.shape[0]) in self.fold_buckets:
            return self.forward_folded(input_ids, positions, kv_caches, metadata)
        hidden = self.model.embed_tokens(input_ids)
        stream_dtype = self.residual_dtype or hidden.dtype
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache, kv_cache, metadata,
                                     stream_dtype)
        normed, _ = self.model.norm(hidden, residual, stream_dtype)  # residual += last MLP output
        return normed

    def forward_folded(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                       metadata: AttentionMetadata) -> torch.Tensor:
        """`forward` with the decoder norms folded into the projections (a step of at most 64 rows in
        `fold_buckets`; runtime/models/norm_fold.py): the first layer's input norm starts the float32 stream,
        each layer adds to it in place (`LlamaDecoderLayer.forward_folded`), the final norm reads it.
        Returns [num_tokens, hidden_size] in the model dtype, as `forward`."""
        hidden = self.model.embed_tokens(input_ids)
        layers = self.model.layers
        x, stream = layers[0].input_layernorm(hidden, stream_dtype=torch.float32)
        sumsq = None
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            x, sumsq = layer.forward_folded(x, sumsq, stream, positions, self.cos_sin_cache, kv_cache, metadata)
        norm = self.model.norm
        return norm.ops.rms_norm(stream, norm.weight, norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] → logits [N, vocab_size] float32 (computed in float32, see LMHead)."""
        return self.lm_head(hidden).float()

    # -- weights ---------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters (fused projections get their slices).

        Raises:
            ValueError: a tensor has no home or the wrong shape, or a parameter got no tensor.
        """
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # older checkpoints save the RoPE frequencies; we rebuild them
            name, start, size = self._param_slot(hf_name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints also store the head; the embedding wins, as in HF
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            target = params[name].data if start is None else params[name].data.narrow(0, start, size)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            filled.add(hf_name)
        missing = sorted(self.expected_checkpoint_names() - filled)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")

    def _param_slot(self, hf_name: str) -> tuple[str, int | None, int]:
        """(our parameter name, row offset or None, rows) for one HF tensor name."""
        c = self.config
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_size),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_size, kv_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_size + kv_size, kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, c.intermediate_size),
            "mlp.up_proj": ("mlp.gate_up_proj", c.intermediate_size, c.intermediate_size),
        }
        for hf_part, (ours, start, size) in fused.items():
            if f".{hf_part}." in hf_name:
                return hf_name.replace(hf_part, ours), start, size
        return hf_name, None, 0

    def export_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The inverse of load_weights: (HF tensor name, tensor) pairs, fused projections split (views)."""
        params = dict(self.named_parameters())
        for hf_name in sorted(self.expected_checkpoint_names()):
            name, start, size = self._param_slot(hf_name)
            yield hf_name, params[name] if start is None else params[name][start:start + size]

    def expected_checkpoint_names(self) -> set[str]:
        """The HF tensor names a complete checkpoint of this model holds."""
        split = {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        }
        names: set[str] = set()
        for name, _ in self.named_parameters():  # a tied lm_head is listed once, as the embedding
            fused = next((part for part in split if f".{part}." in name), None)
            if fused is None:
                names.add(name)
            else:
                names.update(name.replace(fused, hf_part) for hf_part in split[fused])
        return names
