"""Reading a PEFT LoRA adapter directory and checking it against the base model.

A PEFT adapter is `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, optionally
`use_rslora`, `fan_in_fan_out`) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in_features]) and
`...lora_B.weight` ([out_features, r]). The delta an adapter adds to a targeted linear layer is
`scale · B · A` with `scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA).

`fan_in_fan_out` only says how the *base* weight is laid out (GPT-2's Conv1D); PEFT stores lora_A
and lora_B as ordinary linear weights either way, so the layout read here does not depend on it.

An `hf://org/name[@revision]` adapter is fetched by the base model's Hub helper (`hf_snapshot_dir`:
the same Hugging Face cache, HF_TOKEN and HF_HUB_OFFLINE) before it is read.

Every problem is a `LoraConfigError` naming `--lora-modules` (or `--max-lora-rank`), raised before any
adapter is written into the model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sits.runtime.lora.config import HF_SCHEME, LoraConfigError, LoraFileError, LoraModule
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.errors import ModelLoadError

# The projections an adapter may target, each with the fused module of ours that holds it and its
# slice index there (q/k/v live in qkv_proj, gate/up in gate_up_proj).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
EMBEDDING_TARGETS = ("embed_tokens", "lm_head")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def target_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of the base model."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


@dataclass
class LoraAdapter:
    """One adapter, read and checked.

    Attributes:
        module: the name and path it is served under.
        rank: r.
        scale: what B · A is multiplied by (lora_alpha / r, or / sqrt(r) with rsLoRA).
        weights: (layer index, target) -> (A [r, in_features], B [out_features, r]), float32 on the CPU.
    """

    module: LoraModule
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.weights}


def load_adapter(module: LoraModule, config: LlamaConfig, max_rank: int, where: str | None = None) -> LoraAdapter:
    """Read `module.path` and check it fits the base model described by `config`.

    `where` starts every error message (default: the `--lora-modules` value).

    Raises:
        LoraConfigError: a missing directory or file, an hf:// repository that cannot be had, a rank above
            max_rank, an unknown or unsupported target (embeddings, lm_head), or a tensor whose shape does
            not match the base model.
    """
    where = where or f"--lora-modules {module.name}={module.path}"
    directory = adapter_directory(module, where)
    if not directory.is_dir():
        raise LoraFileError(f"{where}: no such adapter directory")
    settings = _read_config(directory, where)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoraConfigError(f"{where}: adapter_config.json needs a positive integer r and a numeric lora_alpha")
    if rank > max_rank:
        raise LoraConfigError(f"{where}: the adapter has rank {rank}, above --max-lora-rank {max_rank}; "
                              f"raise --max-lora-rank to at least {rank}")
    _check_targets(settings, where)
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    adapter = LoraAdapter(module, rank, float(scale))
    tensors = _read_tensors(directory, where)
    shapes = target_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if any(f".{name}." in key for name in EMBEDDING_TARGETS) or "lora_embedding" in key:
            raise LoraConfigError(f"{where}: adapters of the embeddings or lm_head are not supported ({key})")
        if match is None:
            raise LoraConfigError(f"{where}: unexpected tensor {key!r} (only lora_A / lora_B weights of "
                                  f"{', '.join(TARGETS)} are supported)")
        layer, target, half = int(match[1]), match[2], match[3]
        if target not in TARGETS:
            raise LoraConfigError(f"{where}: unknown target module {target!r} in {key!r} "
                                  f"(supported: {', '.join(TARGETS)})")
        if layer >= config.num_hidden_layers:
            raise LoraConfigError(f"{where}: tensor {key!r} is for layer {layer}, but the base model has "
                                  f"{config.num_hidden_layers} layers")
        in_features, out_features = shapes[target]
        expected = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise LoraConfigError(f"{where}: tensor {key!r} has shape {tuple(tensor.shape)}, but the base model "
                                  f"needs {expected}: the adapter was not trained for this model")
        halves.setdefault((layer, target), {})[half] = tensor.float()
    for (layer, target), pair in sorted(halves.items()):
        if len(pair) != 2:
            raise LoraConfigError(f"{where}: layer {layer} {target} has lora_{next(iter(pair))} but not its pair")
        adapter.weights[(layer, target)] = (pair["A"], pair["B"])
    if not adapter.weights:
        raise LoraConfigError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return adapter


def adapter_directory(module: LoraModule, where: str) -> Path:
    """The local directory of the adapter: its path, or the Hub repository downloaded into the HF cache."""
    if not module.path.startswith(HF_SCHEME):
        return Path(module.path).expanduser()
    from sits.runtime.models.loading import hf_snapshot_dir  # huggingface_hub is imported only there

    try:
        return hf_snapshot_dir(module.path)
    except ModelLoadError as error:
        raise LoraConfigError(f"{where}: {error}") from None


def _read_config(directory: Path, where: str) -> dict:
    path = directory / "adapter_config.json"
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraFileError(f"{where}: the directory has no adapter_config.json") from None
    except (OSError, ValueError) as error:
        raise LoraFileError(f"{where}: adapter_config.json cannot be read: {error}") from None
    if not isinstance(settings, dict):
        raise LoraFileError(f"{where}: adapter_config.json is not a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoraConfigError(f"{where}: a {settings['peft_type']} adapter, only LORA is supported")
    return settings


def _check_targets(settings: dict, where: str) -> None:
    """Refuse what the adapter's config asks for that the delta layers cannot do."""
    targets = settings.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for name in names:
        short = str(name).rsplit(".", 1)[-1]
        if short in EMBEDDING_TARGETS:
            raise LoraConfigError(f"{where}: adapters of the embeddings or lm_head are not supported "
                                  f"(target_modules has {name!r})")
        if isinstance(targets, list) and short not in TARGETS:
            raise LoraConfigError(f"{where}: unknown target module {name!r} (supported: {', '.join(TARGETS)})")
    if settings.get("modules_to_save"):
        raise LoraConfigError(f"{where}: modules_to_save ({settings['modules_to_save']}) is not supported")
    for option in ("use_dora", "rank_pattern", "alpha_pattern"):
        if settings.get(option):
            raise LoraConfigError(f"{where}: {option} is not supported")
    if settings.get("bias", "none") != "none":
        raise LoraConfigError(f"{where}: LoRA biases (bias={settings['bias']!r}) are not supported")


def _read_tensors(directory: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = directory / "adapter_model.safetensors"
    if not path.is_file():
        other = " (adapter_model.bin is not read: save it with safetensors)" if (
            directory / "adapter_model.bin").exists() else ""
        raise LoraFileError(f"{where}: the directory has no adapter_model.safetensors{other}")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError) as error:
        raise LoraFileError(f"{where}: adapter_model.safetensors cannot be read: {error}") from None
