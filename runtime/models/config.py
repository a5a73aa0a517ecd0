"""The shape of a Llama-family decoder, read from an HF `config.json` (or built from GGUF metadata).

One dataclass covers Llama 2/3, Mistral, Qwen2 and SmolLM2: they differ only in RoPE scaling,
biases, GQA ratio and whether the output head shares the embedding matrix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# HF `architectures[0]` → our family name. Everything here runs through `LlamaForCausalLM`.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this runtime cannot run; the message says what and why."""


@dataclass
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder.

    Attributes:
        vocab_size: rows of the embedding and output matrices.
        hidden_size: model width.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA when fewer than query heads).
        head_dim: width of one head.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES and its parameters
            (HF spelling: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings;
            "freq_factors" carries GGUF's per-frequency divisors under "factors").
        max_position_embeddings: the context the checkpoint was trained for, in tokens.
        tie_word_embeddings: the output head reuses the embedding matrix.
        attention_bias: q/k/v projections have a bias (Qwen2, Llama with attention_bias).
        bos_token_id: beginning-of-sequence token, if any.
        eos_token_ids: every token id that ends generation.
        architecture: family name: "llama", "mistral" or "qwen2".
        o_proj_bias: the attention output projection has a bias (Llama's attention_bias; not Qwen2).
        mlp_bias: the MLP projections have biases.
        sliding_window: Mistral's attention window in tokens, or None for full attention.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    # -- derived sizes the engine needs to size the KV cache -------------------------------------

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's k_cache (and v_cache): [num_blocks, block_size, num_kv_heads, head_dim]."""
        return (num_blocks, block_size, self.num_key_value_heads, self.head_dim)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def validate(self) -> None:
        """Raise UnsupportedModelError when the numbers cannot describe a working model."""
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise UnsupportedModelError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"config: head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"config: rope scaling {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Inverse of to_dict."""
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Read an HF `config.json` dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`).

        Raises:
            UnsupportedModelError: an architecture, activation or feature this runtime does not run.
        """
        architecture = _architecture(d)
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"config: hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope(d)
        bias = bool(d.get("attention_bias", False))
        sliding_window = d.get("sliding_window")
        if architecture == "qwen2":
            # Qwen2 always has q/k/v biases and never an o_proj bias; its window is off unless enabled.
            sliding_window = sliding_window if d.get("use_sliding_window", False) else None
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias or architecture == "qwen2",
            o_proj_bias=bias and architecture != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_id_list(d.get("eos_token_id")),
            architecture=architecture,
            sliding_window=int(sliding_window) if sliding_window else None,
        )


def _architecture(d: dict[str, Any]) -> str:
    names = d.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    model_type = d.get("model_type")
    if not names and model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    found = ", ".join(names) or f"model_type {model_type!r}"
    raise UnsupportedModelError(
        f"architecture {found} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either spelling of the HF config."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    merged.pop("rope_theta", None)
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **merged}


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]

