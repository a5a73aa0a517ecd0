"""The peer of `sits bench`: HF transformers `generate` on the same weights, prompts and GPU.

The run is the one BASELINES.md measured: `LlamaForCausalLM` with SDPA attention and the default
dynamic cache, greedy, every sequence forced to exactly output_len tokens (min_new_tokens), the
whole batch in one `generate` call. Its weights are SITS's own, exported through
`LlamaForCausalLM.export_weights` (fused projections split back into HF's q/k/v and gate/up), so
both systems compute the same function.

Timing: one warm-up call on the whole batch (two new tokens); then a prefill-only call (max_new_tokens=1) gives the
time to first token; then the full call gives the total time. Inter-token latency is the mean of
the decode steps, (total - TTFT) / (output_len - 1): taking per-token timestamps would need a
streamer, which adds a device sync per step to transformers' loop.
"""

from __future__ import annotations

import gc
import time

import torch

from sits.runtime.commands.bench_report import RunResult
from sits.runtime.models.config import LlamaConfig


def hf_config(config: LlamaConfig, dtype: torch.dtype):
    """transformers' LlamaConfig for our shape."""
    from transformers import LlamaConfig as HFLlamaConfig

    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
    eos = config.eos_token_ids or [0]
    return HFLlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, rope_parameters=rope,
        bos_token_id=config.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos, pad_token_id=eos[0],
        dtype=dtype,
    )  # fmt: skip


def transformers_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
    """An HF LlamaForCausalLM (SDPA) holding a copy of `model`'s weights, on `device` in `dtype`.

    Raises:
        ValueError: the HF model lacks or has extra tensors compared with ours.
    """
    from transformers import AutoModelForCausalLM

    config = hf_config(model.config, dtype)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    weights = {name: tensor.detach().to(device=device, dtype=dtype) for name, tensor in model.export_weights()}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    if model.config.tie_word_embeddings:
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"weights do not match transformers' model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return hf.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _generate(hf, prompts: torch.Tensor, new_tokens: int, pad_id: int) -> torch.Tensor:
    return hf.generate(
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=pad_id, use_cache=True,
    )


def run_transformers(model: torch.nn.Module, prompts: list[list[int]], output_len: int, device: torch.device,
                     dtype: torch.dtype) -> RunResult:
    """Time transformers' generate on the batch (all prompts the same length); frees its model after."""
    import transformers

    hf = transformers_model(model, device, dtype)
    pad_id = (model.config.eos_token_ids or [0])[0]
    batch = torch.tensor(prompts, dtype=torch.long, device=device)
    try:
        _generate(hf, batch, 2, pad_id)  # warm-up at full size: kernels, cuBLAS handles, allocator
        _sync(device)
        start = time.perf_counter()
        _generate(hf, batch, 1, pad_id)
        _sync(device)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = _generate(hf, batch, output_len, pad_id)
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        del hf
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    generated = int(out.shape[1]) - batch.shape[1]
    if generated != output_len:
        raise RuntimeError(f"transformers generated {generated} tokens per sequence, expected {output_len}")
    itl = (seconds - ttft) / max(output_len - 1, 1)
    return RunResult(
        system=f"transformers {transformers.__version__} generate (SDPA, dynamic cache)", short="transformers",
        seconds=seconds, output_tokens=len(prompts) * output_len, prompt_tokens=sum(map(len, prompts)),
        ttft_s=[ttft] * len(prompts), itl_s=[itl], itl_is_mean=True,
    )
