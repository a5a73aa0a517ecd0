"""LoRA adapters for the tests, and their reference: the base model with the adapter merged into its
weights (W + scale · B · A), as transformers runs it.

`write_peft_adapter` saves random A / B (fixed seed) in PEFT's layout: adapter_config.json and
adapter_model.safetensors named `base_model.model.model.layers.{i}.<module>.lora_A.weight`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from sits.runtime.models.config import LlamaConfig

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def projection_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection, computed here from the model's shape."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_peft_adapter(directory: Path, config: LlamaConfig, *, rank: int = 8, alpha: float = 16,
                       targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0, b_std: float = 0.2,
                       use_rslora: bool = False, extra_config: dict | None = None,
                       extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A random PEFT adapter over every layer: A ~ N(0, 1/in) [r, in], B ~ N(0, b_std²) [out, r]."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            in_features, out_features = shapes.get(target, (config.hidden_size, config.hidden_size))
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT.get(target, 'mlp')}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / math.sqrt(
                in_features)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * b_std
    tensors.update(extra_tensors or {})
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                "use_rslora": use_rslora, "fan_in_fan_out": False, "bias": "none", "lora_dropout": 0.0,
                "task_type": "CAUSAL_LM", **(extra_config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory


def merged_hf_model(checkpoint_dir: Path, adapter_dir: Path | None):
    """transformers' LlamaForCausalLM from `checkpoint_dir`, with the adapter merged into its weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    settings = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank, alpha = settings["r"], settings["lora_alpha"]
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, lora_a in tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            lora_b = tensors[name.replace(".lora_A.", ".lora_B.")]
            weight = params[name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")]
            weight += scale * (lora_b.double() @ lora_a.double()).float()
    return model


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (EOS allowed only after max_tokens, as min_tokens does) and each
    chosen token's log-probability under the raw logits."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(logits[0].float(), -1)[token].item() for logits, token in zip(out.logits, tokens,
                                                                                                 strict=True)]
    return tokens, logprobs
