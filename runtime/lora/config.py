"""The LoRA options of `sits serve` (vLLM's `--enable-lora`, `--lora-modules`, `--max-loras`,
`--max-lora-rank`), validated into one-line errors naming the flag.

An adapter's path is a local PEFT directory or, as for `--model`, `hf://org/name[@revision]`: a Hub
repository downloaded into the Hugging Face cache when the adapters load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

HF_SCHEME = "hf://"
RUNTIME_UPDATING_ENV = "SITS_ALLOW_RUNTIME_LORA_UPDATING"  # as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING


class LoraConfigError(ValueError):
    """A LoRA option or adapter is unusable; the message names the flag (a `ConfigError` at the CLI)."""


class LoraFileError(LoraConfigError):
    """An adapter's files are missing or cannot be read or parsed (its message tells what exists on
    disk: the runtime load endpoint answers these with one generic message, `lora.roots`)."""


@dataclass(frozen=True)
class LoraModule:
    """One adapter served under `name` (the OpenAI model id a request sends).

    Attributes:
        name: the model id clients ask for.
        path: the PEFT adapter directory (adapter_config.json + adapter_model.safetensors), or
            `hf://org/name[@revision]`, a Hub repository holding those files.
        base_model_name: what `/v1/models` reports as its parent; None: the served base model.
    """

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """One `--lora-modules` value: `name=path`, or vLLM's JSON `{"name", "path", "base_model_name"}`.

    Raises:
        LoraConfigError: neither form, or an empty name or path.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise LoraConfigError(f"--lora-modules {text!r} is not valid JSON: {error.msg}") from None
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"}) if isinstance(spec, dict) else []
        if not isinstance(spec, dict) or unknown:
            raise LoraConfigError(f"--lora-modules {text!r}: a JSON value holds only name, path and base_model_name")
        name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name")
        if not (isinstance(name, str) and isinstance(path, str) and (base is None or isinstance(base, str))):
            raise LoraConfigError(f"--lora-modules {text!r}: name and path must be strings")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise LoraConfigError(f"--lora-modules {text!r} must be NAME=PATH or a JSON object")
    if not name.strip() or not path.strip():
        raise LoraConfigError(f"--lora-modules {text!r}: the name and the path must not be empty")
    return LoraModule(name.strip(), path.strip(), base)


@dataclass
class LoraConfig:
    """Multi-LoRA serving.

    Attributes:
        enable_lora: wrap the model's linear layers so requests can pick an adapter.
        modules: the adapters, all loaded at start-up.
        max_loras: adapter slots (at most this many adapters in one batch); every configured adapter
            holds a slot, so it must be at least len(modules); with runtime updates the rest are free for
            adapters loaded later. None: len(modules), at least 1.
        max_lora_rank: the largest rank an adapter may have (the slots are sized for it).
        allow_runtime_updating: adapters may be loaded into free slots and unloaded while serving
            (`--allow-runtime-lora-updating`, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter).
    """

    enable_lora: bool = False
    modules: list[LoraModule] = field(default_factory=list)
    max_loras: int | None = None
    max_lora_rank: int = 16
    allow_runtime_updating: bool = False

    @property
    def num_slots(self) -> int:
        """Adapter slots to allocate (slot 0, "no adapter", comes on top)."""
        return self.max_loras if self.max_loras is not None else max(1, len(self.modules))

    def validate(self) -> None:
        if self.modules and not self.enable_lora:
            raise LoraConfigError("--lora-modules needs --enable-lora")
        if self.allow_runtime_updating and not self.enable_lora:
            raise LoraConfigError("--allow-runtime-lora-updating needs --enable-lora")
        if self.max_lora_rank < 1:
            raise LoraConfigError(f"--max-lora-rank must be positive, got {self.max_lora_rank}")
        if self.max_loras is not None and self.max_loras < 1:
            raise LoraConfigError(f"--max-loras must be positive, got {self.max_loras}")
        if self.max_loras is not None and self.max_loras < len(self.modules):
            raise LoraConfigError(
                f"--max-loras {self.max_loras} is less than the {len(self.modules)} adapters of --lora-modules "
                "(every adapter is loaded at start-up and holds a slot); raise --max-loras")
        names = [module.name for module in self.modules]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise LoraConfigError(f"--lora-modules names {duplicate!r} twice")
        for module in self.modules:  # before the model loads: a typo in a path costs no loading time
            if module.path.startswith(HF_SCHEME):
                _check_hub_uri(module)
            elif not Path(module.path).expanduser().is_dir():
                raise LoraConfigError(f"--lora-modules {module.name}={module.path}: no such adapter directory")


def _check_hub_uri(module: LoraModule) -> None:
    """The form of an hf:// adapter, checked as `--model hf://` is (the download comes when adapters load)."""
    from sits.runtime.models.loading import HF_REPO_ID, HF_REVISION

    repo_id, at, revision = module.path[len(HF_SCHEME):].partition("@")
    if not HF_REPO_ID.match(repo_id) or (at and not HF_REVISION.match(revision)):
        raise LoraConfigError(f"--lora-modules {module.name}={module.path} is not a Hugging Face repository: "
                              "expected hf://org/name or hf://org/name@revision")
