"""The strongest plain-PyTorch peer of `sits bench`: a static KV cache and one compiled decode step.

What a capable user writes in an afternoon (gpt-fast's recipe; ../shared/BASELINES.md measured it at 4.73 ms a step at
batch 1 and 7.39 at batch 32 on the H200): the decoder's weights and a static KV cache of batch x max_len slots per
layer held by one module, attention over the whole cache under a mask of the filled slots (each KV head read once
for its group of query heads: two batched matmuls and a float32 softmax), and the decode step compiled with
`torch.compile(mode="reduce-overhead")`, which replays it as a CUDA graph. The prompt is prefilled eagerly (causal
SDPA over the prompt).

`StaticCacheDecoder` reads SITS's own weights from a `LlamaForCausalLM` (the same tensors, not copies: fused qkv and
gate_up split here), so both systems compute the same function; `run_static_compiled` times it on `sits bench`'s
batch: time to first token (the prefill), then output_len - 1 compiled greedy steps (ITL: their mean). On a CPU the
step runs eagerly (no CUDA graphs to replay), and the label says so.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.nn.functional as F
from torch import nn

from sits.kernels.reference import rms_norm_reference as _rms_norm
from sits.runtime.commands.bench_report import RunResult

_LAYER_KEYS = ("in_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias", "down",
               "down_bias")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32: x [B, heads, T, D]; cos / sin [T, D / 2] broadcast over batch and heads."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _grouped_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """One query token per sequence against the whole cache, each KV head read once for its group of query heads.

    q [B, heads, 1, D]; k_cache, v_cache [B, kv_heads, L, D]; mask [1, 1, 1, L] bool (True: attend) -> [B, heads,
    1, D] in q's dtype. Scores in float32 (softmax too), probabilities rounded to the cache dtype for P·V.
    """
    b, heads, _, d = q.shape
    kv_heads = k_cache.shape[1]
    grouped = q.view(b, kv_heads, heads // kv_heads, d)  # query heads h = g * groups + j share KV head g
    scores = torch.matmul(grouped, k_cache.transpose(-1, -2)).float() * scale  # [B, kv_heads, groups, L]
    probs = torch.softmax(scores.masked_fill(~mask[0], float("-inf")), dim=-1).to(v_cache.dtype)
    return torch.matmul(probs, v_cache).view(b, heads, 1, d)


def _plain_weight(module: nn.Module, name: str) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the static-cache peer runs unquantized models only; {name} is {type(module).__name__}")
    return weight


class StaticCacheDecoder(nn.Module):
    """SITS's Llama weights with a static KV cache: eager prefill, and a decode step fit for torch.compile.

    Args:
        model: a sits LlamaForCausalLM (unquantized, one shard); its weights are shared, not copied.
        batch: sequences decoded together.
        max_len: cache slots per sequence (prompt + output tokens).
    Buffers: k_cache_i / v_cache_i [batch, kv_heads, max_len, head_dim] in the model dtype, one pair per layer.
    """

    def __init__(self, model: nn.Module, batch: int, max_len: int) -> None:
        super().__init__()
        c = model.config
        self.eps, self.heads, self.kv_heads, self.head_dim = c.rms_norm_eps, c.num_attention_heads, \
            c.num_key_value_heads, c.head_dim
        decoder = model.model
        self._share("embed", decoder.embed_tokens.weight)
        self._share("final_norm", decoder.norm.weight)
        self._share("lm_head", _plain_weight(model.lm_head, "lm_head"))
        self.num_layers = len(decoder.layers)
        for i, layer in enumerate(decoder.layers):
            self._share_layer(i, layer)
        dtype, device = self.embed.dtype, self.embed.device
        for i in range(self.num_layers):
            for kind in ("k", "v"):
                self.register_buffer(f"{kind}_cache_{i}", torch.zeros(batch, self.kv_heads, max_len, self.head_dim,
                                                                      dtype=dtype, device=device), persistent=False)
        half = self.head_dim // 2
        table = model.cos_sin_cache[:max_len].to(device)  # [max_len, head_dim] float32: cos halves, then sin
        self.register_buffer("cos", table[:, :half].contiguous(), persistent=False)
        self.register_buffer("sin", table[:, half:].contiguous(), persistent=False)
        self.register_buffer("slots", torch.arange(max_len, device=device), persistent=False)

    def _share(self, name: str, tensor: torch.Tensor | None) -> None:
        """Hold SITS's tensor as this module's own parameter (the same storage; None stays None), so that
        torch.compile treats it as a weight (a static address in the CUDA graph), not as an input to copy at
        every replay."""
        param = tensor if tensor is None or isinstance(tensor, nn.Parameter) else nn.Parameter(tensor,
                                                                                               requires_grad=False)
        self.register_parameter(name, param)

    def _weights(self, index: int) -> dict[str, torch.Tensor | None]:
        """Layer `index`'s weights by role (read off this module's attributes, as torch.compile traces them)."""
        return {key: getattr(self, f"layer{index}_{key}") for key in _LAYER_KEYS}

    def _share_layer(self, index: int, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        tensors = {
            "in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
            "qkv": _plain_weight(attn.qkv_proj, f"layer {index} qkv_proj"), "qkv_bias": attn.qkv_proj.bias,
            "o": _plain_weight(attn.o_proj, f"layer {index} o_proj"), "o_bias": attn.o_proj.bias,
            "gate_up": _plain_weight(mlp.gate_up_proj, f"layer {index} gate_up_proj"),
            "gate_up_bias": mlp.gate_up_proj.bias,
            "down": _plain_weight(mlp.down_proj, f"layer {index} down_proj"), "down_bias": mlp.down_proj.bias,
        }
        for key in _LAYER_KEYS:
            self._share(f"layer{index}_{key}", tensors[key])

    def _attention_in(self, w: dict, x: torch.Tensor, positions: slice | torch.Tensor):
        """x [B, T, H] -> (q [B, heads, T, D], k, v [B, kv_heads, T, D]), RoPE applied at `positions`."""
        b, t, _ = x.shape
        qkv = F.linear(_rms_norm(x, w["in_norm"], self.eps), w["qkv"], w["qkv_bias"])
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[positions], self.sin[positions]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _rest_of_layer(self, w: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] plus o_proj(attn [B, heads, T, D]), then plus the SwiGLU MLP: [B, T, H]."""
        b, _, t, _ = attn.shape
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, self.heads * self.head_dim), w["o"], w["o_bias"])
        gate, up = F.linear(_rms_norm(x, w["post_norm"], self.eps), w["gate_up"], w["gate_up_bias"]).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, w["down"], w["down_bias"])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(x, self.final_norm, self.eps), self.lm_head).float()

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] int64 (S <= max_len) into the cache's first S slots: the last position's logits [B, V]
        float32."""
        s = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        for i in range(self.num_layers):
            w = self._weights(i)
            q, k, v = self._attention_in(w, x, slice(0, s))
            getattr(self, f"k_cache_{i}")[:, :, :s] = k
            getattr(self, f"v_cache_{i}")[:, :, :s] = v
            groups = self.heads // self.kv_heads
            attn = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                  is_causal=True)
            x = self._rest_of_layer(w, x, attn)
        return self._logits(x[:, -1])

    def decode(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One step: tokens [B] int64 at position [1] int64 (the same for every sequence), written into slot
        `position`; attention over the whole cache under the mask of slots <= position (`_grouped_attention`).
        Logits [B, V] float32."""
        x = F.embedding(tokens, self.embed)[:, None]  # [B, 1, H]
        mask = (self.slots <= position)[None, None, None, :]  # [1, 1, 1, max_len]
        for i in range(self.num_layers):
            w = self._weights(i)
            q, k, v = self._attention_in(w, x, position)
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            k_cache.index_copy_(2, position, k)
            v_cache.index_copy_(2, position, v)
            attn = _grouped_attention(q, k_cache, v_cache, mask, self.head_dim**-0.5)
            x = self._rest_of_layer(w, x, attn)
        return self._logits(x[:, 0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_step(decoder: StaticCacheDecoder, compiled: bool):
    """(tokens [B], position [1]) -> next tokens [B]: the decode step and its argmax, compiled with
    mode="reduce-overhead" (CUDA graphs) when `compiled`, else eager."""

    def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return decoder.decode(tokens, position).argmax(-1)

    return torch.compile(step, mode="reduce-overhead", fullgraph=True) if compiled else step


@torch.inference_mode()
def _decode(step, first: torch.Tensor, start: int, steps: int, compiled: bool) -> None:
    """`steps` greedy steps from tokens `first` [B] at positions start, start + 1, ... (each step's tokens feed the
    next; nothing is kept: only the time is wanted)."""
    tokens = first
    position = torch.tensor([start], dtype=torch.long, device=first.device)
    for _ in range(steps):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        tokens = step(tokens, position).clone()  # the graph's output buffer is reused by its next replay
        position += 1


def run_static_compiled(model: nn.Module, prompts: list[list[int]], output_len: int,
                        device: torch.device) -> RunResult:
    """Time the static-cache peer on the batch (all prompts the same length); frees its cache after.

    Compiled (CUDA graphs) on a CUDA device, eager elsewhere. A warm-up (prefill + 3 steps) compiles and
    captures first. Raises ValueError for a quantized model or prompts of different lengths.
    """
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the static-cache peer needs prompts of one length")
    compiled = device.type == "cuda"
    batch = torch.tensor(prompts, dtype=torch.long, device=device)
    decoder = StaticCacheDecoder(model, batch.shape[0], batch.shape[1] + output_len)
    step = greedy_step(decoder, compiled)
    try:
        _decode(step, decoder.prefill(batch).argmax(-1), batch.shape[1], min(3, output_len - 1), compiled)
        _sync(device)
        start = time.perf_counter()
        first = decoder.prefill(batch).argmax(-1)
        _sync(device)
        ttft = time.perf_counter() - start
        _decode(step, first, batch.shape[1], output_len - 1, compiled)
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        del decoder, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    how = "torch.compile reduce-overhead" if compiled else "eager: no CUDA graphs on the CPU"
    return RunResult(
        system=f"PyTorch static cache ({how})", short="static cache", seconds=seconds, output_tokens=len(prompts) * output_len,
        prompt_tokens=sum(map(len, prompts)), ttft_s=[ttft] * len(prompts),
        itl_s=[(seconds - ttft) / max(output_len - 1, 1)], itl_is_mean=True,
    )
