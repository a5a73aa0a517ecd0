"""LoRA adapters of a SitsDeployment: `spec.model.loraAdapters` and `spec.engine.maxLoras` / `maxLoraRank`.

Each adapter is served beside the base model under its own OpenAI model id (vLLM's
`--lora-modules name=path`), read from the same kinds of URI as the base model. The runtime loads
every adapter at start-up into a slot of its own, and refuses LoRA with tensor parallelism or a
quantized base model; the operator refuses those specs too, so a pod never crash-loops on them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sits.operator.fields import Fields, SpecError, spec_field

# An OpenAI model id that is also a directory name and a `--lora-modules NAME=PATH` name (no '=').
LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# Where a checkpoint is read from, the base model's (spec.model.uri) as an adapter's.
MODEL_URI = re.compile(r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/.*)?|hf://[^/\s]+(/[^/\s]+)?|file:///\S*)$")
MODEL_URI_FORM = "pvc://claim/path, hf://org/name[@revision] or file:///path"
DEFAULT_MAX_LORA_RANK = 16  # the runtime's --max-lora-rank default
MAX_ADAPTERS = 64  # every adapter holds a slot on the GPU; the CRD's maxItems
ADAPTER_FIELDS = {"name", "uri"}
ENGINE_FIELDS = {"maxLoras", "maxLoraRank"}


@dataclass(frozen=True)
class LoraAdapterSpec:
    """One adapter: `name` (the model id requests send) and `uri` (pvc://, hf:// or file:///, a PEFT directory)."""

    name: str = spec_field("name", "string", pattern=LORA_NAME,
                           what="an OpenAI model id: letters, digits, '.', '_' or '-' (at most 63)")
    uri: str = spec_field("uri", "string", pattern=MODEL_URI, what=MODEL_URI_FORM)


@dataclass(frozen=True)
class LoraSpec:
    """The adapters and their slots. `max_loras` None: one slot per adapter."""

    adapters: tuple[LoraAdapterSpec, ...] = ()
    max_loras: int | None = None
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK

    @property
    def slots(self) -> int:
        """Adapter slots the runtime allocates (`--max-loras`)."""
        return self.max_loras if self.max_loras is not None else len(self.adapters)

    def model_dict(self) -> dict[str, Any]:
        """The `spec.model` keys of this block (for WorkloadSpec.to_dict)."""
        if not self.adapters:
            return {}
        return {"loraAdapters": [{"name": a.name, "uri": a.uri} for a in self.adapters]}

    def engine_dict(self) -> dict[str, Any]:
        """The `spec.engine` keys this block set away from their defaults."""
        data: dict[str, Any] = {}
        if self.max_loras is not None:
            data["maxLoras"] = self.max_loras
        if self.max_lora_rank != DEFAULT_MAX_LORA_RANK:
            data["maxLoraRank"] = self.max_lora_rank
        return data


def parse_lora(model: Fields, engine: Fields, *, model_name: str, quantization: str,
               gpus_per_replica: int) -> LoraSpec:
    """The LoRA block of a spec: adapters from `model` (spec.model), slots and rank from `engine` (spec.engine).

    Raises:
        SpecError: naming the field, for a malformed, duplicate or base-model name, a bad URI, too few
            slots, or adapters on a workload the runtime cannot serve them on.
    """
    adapters: list[LoraAdapterSpec] = []
    for path, item in model.items("loraAdapters"):
        fields = Fields(item, path, ADAPTER_FIELDS)
        adapter = fields.parse_into(LoraAdapterSpec)
        name, uri = adapter.name, adapter.uri
        if name == model_name:
            raise SpecError(fields.at("name"), f"{name!r} is the base model's name (spec.model.name); "
                                               "an adapter needs a model id of its own")
        if any(seen.name == name for seen in adapters):
            raise SpecError(fields.at("name"), f"adapter {name!r} appears twice")
        if uri.startswith("pvc://") and ".." in uri[len("pvc://"):].split("/"):
            raise SpecError(fields.at("uri"), f"a pvc:// path must not contain '..', got {uri!r}")
        adapters.append(adapter)
    if len(adapters) > MAX_ADAPTERS:
        raise SpecError(model.at("loraAdapters"), f"at most {MAX_ADAPTERS} adapters, got {len(adapters)}")
    max_loras = engine.integer("maxLoras", None, minimum=1)
    rank = engine.integer("maxLoraRank", DEFAULT_MAX_LORA_RANK, minimum=1)
    assert rank is not None  # a default
    if max_loras is not None and max_loras < len(adapters):
        raise SpecError(engine.at("maxLoras"), f"must be at least the number of spec.model.loraAdapters "
                                               f"({len(adapters)}): every adapter holds a slot, got {max_loras}")
    if adapters and quantization != "none":
        raise SpecError(model.at("loraAdapters"), f"LoRA adapters need an unquantized base model "
                                                  f"(spec.model.quantization none, got {quantization})")
    if adapters and gpus_per_replica > 1:
        raise SpecError(model.at("loraAdapters"), "LoRA adapters do not run with tensor parallelism yet "
                                                  f"(spec.gpusPerReplica at most 1, got {gpus_per_replica})")
    return LoraSpec(tuple(adapters), max_loras, rank)
