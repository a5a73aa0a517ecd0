"""The engine's adapters: every `--lora-modules` adapter loaded into a slot at start-up, and with
--allow-runtime-lora-updating more loaded into free slots (and unloaded) while serving.

`setup_lora` reads and checks every adapter first (so a bad one stops the start before the model
is touched), then hooks a `LoraDelta` onto each linear layer some adapter targets, writes each
adapter into its slot and hands the runner the `LoraStepState` it fills every step. Without
--enable-lora it does nothing at all: the model keeps its plain forward.

Runtime updates: `read` (any thread, slow: disk or Hub) checks an adapter; `add` and `remove` write
and zero its slot and must run on the engine's thread between steps (`AsyncEngine.call_between_steps`),
never while a step reads the stacks. The name -> slot maps are replaced, never mutated, so other
threads may read them at any time. Each runtime load gets a fresh prefix-cache key (the name plus a
load id): blocks cached under an unloaded adapter are never a hit for another loaded under its name.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

from torch import nn

from sits.runtime.config import ConfigError
from sits.runtime.engine.errors import InvalidRequestError
from sits.runtime.lora.adapter import TARGETS, LoraAdapter, load_adapter, target_shapes
from sits.runtime.lora.config import LoraConfig, LoraConfigError, LoraModule
from sits.runtime.lora.layers import LoraDelta, LoraStepState

if TYPE_CHECKING:
    from sits.runtime.engine.runner import ModelRunner
    from sits.runtime.models.config import LlamaConfig
    from sits.runtime.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# The model's attribute naming the manager whose hooks it carries (a later engine over the same
# model object takes them off before hooking its own).
MANAGER_ATTRIBUTE = "lora_manager"

# Our fused layers and the targets each holds, in slice order.
FUSED_LAYERS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


class LoraManager:
    """Adapters held in slots 1..n of every hooked layer (slot 0 is the base model).

    Args:
        model: the base decoder (`model.model.layers[i].self_attn / .mlp`).
        model_config: its shape.
        config: the LoRA options.
    Attributes:
        modules: name -> LoraModule of each adapter served.
        slots: name -> slot.
        cache_keys: name -> the key its prefix-cache blocks are hashed under.
        step: the per-step adapter index the model runner fills.
    """

    def __init__(self, model: LlamaForCausalLM, model_config: LlamaConfig, config: LoraConfig) -> None:
        adapters = [load_adapter(module, model_config, config.max_lora_rank) for module in config.modules]
        self.model_config, self.max_rank, self.num_slots = model_config, config.max_lora_rank, config.num_slots
        weight = next(model.parameters())
        self.step = LoraStepState(weight.device, config.num_slots, weight.dtype)
        self.modules: dict[str, LoraModule] = {a.module.name: a.module for a in adapters}
        self.slots: dict[str, int] = {a.module.name: slot for slot, a in enumerate(adapters, start=1)}
        self.cache_keys: dict[str, str] = {name: name for name in self.slots}  # as before runtime updates
        self.adapters = adapters
        # an adapter loaded later may target any projection: every layer is hooked up front
        targeted = set(TARGETS) if config.allow_runtime_updating else set().union(*(a.targets for a in adapters))
        shapes = target_shapes(model_config)
        self._deltas: dict[tuple[int, str], LoraDelta] = {}
        previous = getattr(model, MANAGER_ATTRIBUTE, None)
        if previous is not None:  # an earlier engine over the same model object: its hooks go
            previous.detach()
        for index, layer in enumerate(model.model.layers):
            for layer_name, targets in FUSED_LAYERS.items():
                if targeted.isdisjoint(targets):
                    continue
                linear = layer.get_submodule(layer_name)
                if not isinstance(linear, nn.Linear):  # e.g. quantized or sharded: the delta needs the plain layer
                    raise LoraConfigError(f"--enable-lora needs plain linear layers; {layer_name} is a "
                                          f"{type(linear).__name__}")
                sizes = [shapes[target][1] for target in targets]
                self._deltas[(index, layer_name)] = LoraDelta(linear, sizes, config.num_slots, config.max_lora_rank,
                                                              self.step)
        for slot, adapter in enumerate(adapters, start=1):
            self._write(slot, adapter)
        setattr(model, MANAGER_ATTRIBUTE, self)
        self._model = model

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        for (layer, target), (lora_a, lora_b) in adapter.weights.items():
            layer_name, index = TARGETS[target]
            self._deltas[(layer, layer_name)].set_slice(slot, index, lora_a, lora_b, adapter.scale)

    def read(self, module: LoraModule) -> LoraAdapter:
        """Read and check an adapter for a runtime load (any thread; touches no slot).

        Raises:
            LoraConfigError: as at start-up, the message starting with the adapter's name and path.
        """
        return load_adapter(module, self.model_config, self.max_rank, where=f"{module.name} ({module.path})")

    def add(self, adapter: LoraAdapter) -> int:
        """Write `adapter` into the lowest free slot; engine thread only, between steps.

        Raises:
            LoraConfigError: its name is served already, or no slot is free.
        """
        name = adapter.module.name
        if name in self.slots:
            raise LoraConfigError(f"The lora adapter '{name}' has already been loaded.")
        slot = next((s for s in range(1, self.num_slots + 1) if s not in self.slots.values()), None)
        if slot is None:
            raise LoraConfigError(f"No free LoRA slot: all {self.num_slots} slots (--max-loras) hold adapters; "
                                  "unload one first or raise --max-loras")
        self._write(slot, adapter)
        self.cache_keys = {**self.cache_keys, name: f"{name}#{uuid.uuid4().hex}"}
        self.adapters = [*self.adapters, adapter]
        self.slots = {**self.slots, name: slot}
        self.modules = {**self.modules, name: adapter.module}  # last: the server routes to it from now on
        return slot

    def remove(self, name: str) -> None:
        """Unload adapter `name` and zero its slot; engine thread only, between steps, with no
        sequence using it (the caller makes sure). Unknown names are ignored."""
        slot = self.slots.get(name)
        if slot is None:
            return
        self.modules = {n: m for n, m in self.modules.items() if n != name}  # first: the server's 404 from now on
        self.slots = {n: s for n, s in self.slots.items() if n != name}
        self.cache_keys = {n: k for n, k in self.cache_keys.items() if n != name}
        self.adapters = [a for a in self.adapters if a.module.name != name]
        for delta in self._deltas.values():
            delta.clear_slot(slot)

    def slot_of(self, name: str | None) -> int:
        """The slot of adapter `name` (0 for None: the base model).

        Raises:
            InvalidRequestError: no adapter of that name is served.
        """
        if name is None:
            return 0
        slot = self.slots.get(name)
        if slot is None:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r} (served: {', '.join(self.slots) or 'none'})")
        return slot

    def detach(self) -> None:
        """Remove every hook: the model computes the base model alone again."""
        for delta in self._deltas.values():
            delta.remove()
        self._deltas.clear()
        self.step.clear()
        if getattr(self._model, MANAGER_ATTRIBUTE, None) is self:
            delattr(self._model, MANAGER_ATTRIBUTE)


def lora_slot(manager: LoraManager | None, name: str | None) -> int:
    """The slot a request naming adapter `name` runs with (0: the base model).

    Raises:
        InvalidRequestError: an adapter was named but LoRA is off, or no adapter has that name.
    """
    if name is None:
        return 0
    if manager is None:
        raise InvalidRequestError(f"LoRA adapter {name!r} was asked for, but LoRA is not enabled (--enable-lora)")
    return manager.slot_of(name)


def lora_binding(manager: LoraManager | None, name: str | None) -> tuple[int, str | None]:
    """`lora_slot` and the key the request's prefix-cache blocks are hashed under (None: the base model)."""
    slot = lora_slot(manager, name)
    return slot, (manager.cache_keys.get(name, name) if manager is not None and name is not None else None)


def setup_lora(runner: ModelRunner, model: LlamaForCausalLM, model_config: LlamaConfig, config: LoraConfig,
               served_model_name: str) -> LoraManager | None:
    """Load the configured adapters and hand the runner their step state; None without --enable-lora.

    Raises:
        ConfigError: a bad adapter, or one named like the base model (the message names the flag).
    """
    if not config.enable_lora:
        return None
    clash = next((m.name for m in config.modules if m.name == served_model_name), None)
    if clash is not None:
        raise ConfigError(f"--lora-modules {clash}: the adapter has the base model's name; pick another name")
    try:
        manager = LoraManager(model, model_config, config)
    except LoraConfigError as error:
        raise ConfigError(str(error)) from None
    runner.enable_lora(manager.step)
    served = ", ".join(f"{a.module.name} (rank {a.rank}, {a.module.path})" for a in manager.adapters) or "none yet"
    logger.info("LoRA: adapters %s; %d slots, --max-lora-rank %d; steps with LoRA run eagerly (no CUDA graphs)",
                served, config.num_slots, config.max_lora_rank)
    return manager
