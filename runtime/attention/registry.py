"""Which attention back end runs a configuration, and why.

Back ends register themselves with `@register_backend` when their module is imported. The
registry imports the known back-end modules on first use (a module that is absent or cannot be
imported, e.g. Triton on a machine without it, is skipped and the reason logged), so adding a
back end means writing its module; the engine only ever calls `select_backend`.
"""

from __future__ import annotations

import importlib
import logging

import torch

from sits.runtime.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)

# Modules that define back ends; each registers its classes on import.
BACKEND_MODULES = (
    "sits.runtime.attention.torch_ref",
    "sits.runtime.attention.triton",
)

_registry: dict[str, type[AttentionBackend]] = {}
_import_failures: dict[str, str] = {}
_imported = False


class BackendUnavailableError(ValueError):
    """The requested attention back end cannot run this configuration; the message says why."""


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make a back end selectable by its `name` (re-registering replaces it)."""
    _registry[cls.name] = cls
    return cls


def unregister_backend(name: str) -> None:
    """Forget a back end (tests that register their own)."""
    _registry.pop(name, None)


def registered_backends() -> list[type[AttentionBackend]]:
    """Every importable back end, highest priority first."""
    _import_backend_modules()
    return sorted(_registry.values(), key=lambda cls: -cls.priority)


def _import_backend_modules() -> None:
    global _imported
    if _imported:
        return
    _imported = True
    for module in BACKEND_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # absent module or missing optional dependency
            _import_failures[module.rsplit(".", 1)[-1]] = f"{type(exc).__name__}: {exc}"
            # A module that is simply not there is normal; one that fails to import is worth a warning.
            level = logging.DEBUG if getattr(exc, "name", None) == module else logging.WARNING
            logger.log(level, "attention back-end module %s not loaded: %s", module, exc)


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype, head_dim: int) -> AttentionBackend:
    """An instance of the back end to use.

    Args:
        name: "auto" (the highest-priority back end that supports the configuration) or a back-end
            name such as "torch" or "triton".
        device, dtype, head_dim: what the model runs with.
    Raises:
        BackendUnavailableError: the named back end is unknown or does not support the configuration
            (the message gives the reason), or no back end does.
    """
    device = torch.device(device)
    candidates = registered_backends()
    if name != "auto":
        cls = next((c for c in candidates if c.name == name), None)
        if cls is None:
            why = _import_failures.get(name, "not registered")
            known = ", ".join(c.name for c in candidates)
            raise BackendUnavailableError(
                f"attention back end {name!r} is not available ({why}); available: {known}"
            )
        reason = cls.unsupported_reason(device, dtype, head_dim)
        if reason is not None:
            raise BackendUnavailableError(
                f"attention back end {name!r} cannot run {device.type}/{_dtype_name(dtype)}/head_dim {head_dim}: {reason}"
            )
        logger.info("attention back end: %s (requested)", name)
        return cls()

    skipped = []
    for cls in candidates:
        reason = cls.unsupported_reason(device, dtype, head_dim)
        if reason is None:
            detail = f"; skipped {', '.join(skipped)}" if skipped else ""
            logger.info("attention back end: %s (auto, priority %d%s)", cls.name, cls.priority, detail)
            return cls()
        skipped.append(f"{cls.name}: {reason}")
    raise BackendUnavailableError(
        f"no attention back end supports {device.type}/{_dtype_name(dtype)}/head_dim {head_dim}: "
        + "; ".join(skipped)
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
