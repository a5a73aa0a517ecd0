"""Reading a GGUF file as an HF checkpoint: config dict, tokenizer metadata and HF-named tensors.

llama.cpp names tensors its own way (`blk.3.attn_q.weight`) and, for the "llama" architecture,
permutes the rows of Q and K so that RoPE rotates adjacent pairs; HF Llama rotates the two halves
of each head. `iter_hf_tensors` renames and undoes that permutation, so the tensors match what
transformers (and `LlamaForCausalLM.load_weights`) expect.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf

if TYPE_CHECKING:  # torch is only needed to read tensors: metadata and the tokenizer stay torch-free
    import torch

# general.architecture → HF architecture; Mistral 7B files use "llama".
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFError(ValueError):
    """The file is not a GGUF model we can read; the message says why."""


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file.

    Attributes:
        reader: gguf-py's reader (the file is memory-mapped).
        metadata: every key → decoded value.
        architecture: general.architecture ("llama" or "qwen2").
    """

    reader: gguf.GGUFReader
    metadata: dict[str, Any]
    architecture: str

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        try:
            reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError, IndexError) as exc:
            raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from exc
        metadata = {key: field.contents() for key, field in reader.fields.items()}
        architecture = metadata.get("general.architecture")
        if architecture not in GGUF_ARCHITECTURES:
            raise GGUFError(
                f"GGUF architecture {architecture!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
            )
        return cls(reader, metadata, architecture)

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def hf_config(self) -> dict[str, Any]:
        """An HF `config.json` dict describing this model."""
        heads = int(self._meta("attention.head_count"))
        hidden = int(self._meta("embedding_length"))
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        names = self.tensor_names()
        config: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": int(self._meta("vocab_size") or len(tokens)),
            "hidden_size": hidden,
            "intermediate_size": int(self._meta("feed_forward_length")),
            "num_hidden_layers": int(self._meta("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._meta("attention.head_count_kv") or heads),
            "head_dim": int(self._meta("attention.key_length") or hidden // heads),
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._meta("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._meta("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if "tokenizer.ggml.bos_token_id" in self.metadata:
            config["bos_token_id"] = int(self.metadata["tokenizer.ggml.bos_token_id"])
        # Llama 3 instruct files end turns with <|eot_id|> / <|eom_id|>: they stop generation too.
        stops = [int(self.metadata[f"tokenizer.ggml.{key}"]) for key in ("eos_token_id", "eot_token_id", "eom_token_id")
                 if f"tokenizer.ggml.{key}" in self.metadata]
        if stops:
            config["eos_token_id"] = list(dict.fromkeys(stops))
        if self.architecture == "llama" and any(n.endswith("attn_output.bias") for n in names):
            config["attention_bias"] = True
        config.update(self._rope_scaling(names))
        return config

    def _rope_scaling(self, names: set[str]) -> dict[str, Any]:
        if "rope_freqs.weight" in names:  # Llama 3.1: the scaled frequencies' divisors, precomputed
            tensor = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            from sits.runtime.models.gguf_quants import dequantize

            factors = dequantize(tensor.data, int(tensor.tensor_type), (int(tensor.shape[0]),)).float()
            return {"rope_scaling": {"rope_type": "freq_factors", "factors": factors.tolist()}}
        kind = self._meta("rope.scaling.type")
        if kind in (None, "none"):
            return {}
        if kind == "linear":
            return {"rope_scaling": {"rope_type": "linear", "factor": float(self._meta("rope.scaling.factor"))}}
        raise GGUFError(f"GGUF rope scaling {kind!r} is not supported (supported: linear, llama3 frequency factors)")

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every weight, dequantized (float32) or as stored (F32/F16/BF16)."""
        from sits.runtime.models.gguf_quants import dequantize

        heads = int(self._meta("attention.head_count"))
        kv_heads = int(self._meta("attention.head_count_kv") or heads)
        for tensor in self.reader.tensors:
            if tensor.name == "rope_freqs.weight":
                continue  # folded into the config's rope_scaling
            name = hf_tensor_name(tensor.name)
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            value = dequantize(tensor.data, int(tensor.tensor_type), shape)
            if self.architecture == "llama" and ".q_proj." in name:
                value = unpermute_rope_rows(value, heads)
            elif self.architecture == "llama" and ".k_proj." in name:
                value = unpermute_rope_rows(value, kv_heads)
            yield name, value


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp's tensor name → HF's ('blk.3.attn_q.weight' → 'model.layers.3.self_attn.q_proj.weight')."""
    match = _LAYER_NAME.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{kind}"
    raise GGUFError(f"GGUF tensor {gguf_name!r} is not part of a Llama-family model")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs → HF's rotate-half halves).

    Within each head llama.cpp stores rows as (pair, 2); HF wants (2, pair). Works on weights
    [rows, cols] and biases [rows].
    """
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
            .transpose(1, 2).reshape(rows, *rest).contiguous())
