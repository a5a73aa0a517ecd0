"""How every rank builds the same full model before sharding it.

A recipe is a small picklable value: it travels to spawned workers, which build the model from it
themselves (a checkpoint is read by every rank; seeded random weights come out equal on every rank
of one device type). The engine's rank builds from the same recipe, so all ranks hold the same
weights before `apply_tensor_parallel` keeps each one's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sits.runtime.config import ConfigError, EngineConfig, ModelConfig
from sits.runtime.models.config import LlamaConfig
from sits.runtime.models.loading import LoadedModel


@dataclass(frozen=True)
class ModelRecipe:
    """A checkpoint (ModelConfig) or seeded random weights of a given shape.

    Attributes:
        model: source, dtype, device, max_model_len and seed (the seed of random weights).
        attention_backend: "auto", "torch" or "triton".
        random_config: build seeded random weights of this shape instead of reading `model.model`.
    """

    model: ModelConfig
    attention_backend: str = "auto"
    random_config: LlamaConfig | None = None

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> ModelRecipe:
        return cls(model=config.model, attention_backend=config.attention_backend)

    @classmethod
    def random(
        cls,
        config: LlamaConfig,
        *,
        seed: int = 0,
        device: str = "auto",
        dtype: str = "auto",
        attention_backend: str = "auto",
        max_model_len: int | None = None,
    ) -> ModelRecipe:
        """Random N(0, 0.02²) weights of `config`'s shape (tests; benchmarks such as a Llama-3-8B shape)."""
        model = ModelConfig(device=device, dtype=dtype, seed=seed, max_model_len=max_model_len)
        return cls(model=model, attention_backend=attention_backend, random_config=config)

    @property
    def device_type(self) -> str:
        """"cuda" or "cpu" (what "auto" resolves to on this machine)."""
        from sits.runtime.models.loading import resolve_device_dtype

        return resolve_device_dtype(self.model)[0].type

    def llama_config(self, progress: bool = False) -> LlamaConfig:
        """The model's shape, read without loading weights (a GGUF file is converted once first)."""
        if self.random_config is not None:
            return self.random_config
        from sits.runtime.models import loading

        return loading.read_model_config(self.model, progress=progress)

    def load(self, device: torch.device, progress: bool = False) -> LoadedModel:
        """The full (unsharded) model on `device` (a CUDA device must be the current one).

        Raises:
            ConfigError: the attention back end cannot run this model here.
            ModelLoadError: the checkpoint cannot be loaded.
        """
        from sits.runtime.attention.registry import BackendUnavailableError, select_backend
        from sits.runtime.models.loading import build_random_model, load_model, resolve_device_dtype

        dtype = resolve_device_dtype(self.model)[1]
        config = self.llama_config(progress)
        try:
            backend = select_backend(self.attention_backend, device, dtype, config.head_dim)
        except BackendUnavailableError as exc:
            raise ConfigError(f"--attention-backend: {exc}") from exc
        if self.random_config is None:
            return load_model(self.model, backend, progress=progress)
        max_positions = max(config.max_position_embeddings, self.model.max_model_len or 0)
        model = build_random_model(config, backend, device, dtype, seed=self.model.seed, max_positions=max_positions)
        name = self.model.served_model_name or "random-llama"
        return LoadedModel(model, None, config, name, f"random:seed={self.model.seed}", device, dtype)
