"""Which attention back end runs a configuration, and why.

Back ends register themselves with `@register_backend` when their module is imported. The
registry imports the known back-end modules when asked (a module that is absent or cannot be
imported, e.g. Triton on a machine without it, is skipped and the reason logged), so adding a
back end means writing its module; the engine only ever calls `select_backend`.

The registry keeps no state of its own: the registered back ends are the subclasses of
`AttentionBackend` that `register_backend` marked (the mark lives on the class), and why a name is
not available is worked out when it is asked for (the import that failed, the interface version).

External back ends (a package wrapping flash-attn, say) plug in the same way from outside the
repository: a Python entry point in the group `sits.attention_backends` names a module (or a
class) to import. Registration checks the interface version the back end declares: a different
major version than `INTERFACE_VERSION` is refused with a message that says which side to upgrade,
and selecting it by name repeats that message.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

import torch

from sits.runtime.attention.backend import INTERFACE_VERSION, AttentionBackend

logger = logging.getLogger(__name__)

# Modules that define back ends; each registers its classes on import.
BACKEND_MODULES = (
    "sits.runtime.attention.torch_ref",
    "sits.runtime.attention.triton",
)
ENTRY_POINT_GROUP = "sits.attention_backends"

_MARK = "_sits_registered"  # set in the class's own __dict__ by register_backend (subclasses do not inherit it)


class BackendUnavailableError(ValueError):
    """The requested attention back end cannot run this configuration; the message says why."""


class BackendVersionError(BackendUnavailableError, ImportError):
    """A back end implements another major version of the back-end interface."""


def interface_compatibility(cls: type[AttentionBackend]) -> str | None:
    """None when cls implements this runtime's interface major version, else why it cannot be used."""
    declared = str(getattr(cls, "interface_version", "") or "")
    ours_major = INTERFACE_VERSION.split(".")[0]
    theirs_major = declared.split(".")[0]
    if not theirs_major.isdigit():
        return f"declares no valid interface_version ({declared!r}); this runtime implements {INTERFACE_VERSION}"
    if theirs_major == ours_major:
        return None
    newer = int(theirs_major) > int(ours_major)
    fix = "upgrade SITS" if newer else f"upgrade the back end to one written for interface {ours_major}.x"
    return (f"implements attention back-end interface {declared}, but this runtime implements {INTERFACE_VERSION} "
            f"(major versions must match): {fix}")


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make a back end selectable by its `name` (re-registering replaces it).

    Raises:
        BackendVersionError: the back end implements another major version of the interface.
    """
    problem = interface_compatibility(cls)
    if problem is not None:
        raise BackendVersionError(f"attention back end {cls.name!r} {problem}")
    unregister_backend(cls.name)
    setattr(cls, _MARK, True)
    return cls


def unregister_backend(name: str) -> None:
    """Forget a back end (tests that register their own)."""
    for cls in _backend_classes():
        if getattr(cls, "name", None) == name and _MARK in vars(cls):
            delattr(cls, _MARK)


def registered_backends() -> list[type[AttentionBackend]]:
    """Every importable back end, highest priority first."""
    _import_backend_modules()
    return _registered()


def _registered() -> list[type[AttentionBackend]]:
    return sorted((cls for cls in _backend_classes() if _MARK in vars(cls)), key=lambda cls: -cls.priority)


def _backend_classes() -> list[type[AttentionBackend]]:
    """Every subclass of AttentionBackend defined so far, at any depth, in definition order."""
    found: list[type[AttentionBackend]] = []
    pending = [AttentionBackend]
    while pending:
        for sub in pending.pop(0).__subclasses__():
            if sub not in found:
                found.append(sub)
                pending.append(sub)
    return found


def _import_backend_modules() -> dict[str, str]:
    """Import the known back-end modules and the external ones (each import runs once per process;
    one that failed is tried again). Returns why each that failed did: back-end or module name -> reason."""
    failures: dict[str, str] = {}
    for module in BACKEND_MODULES:
        try:
            importlib.import_module(module)
        except BackendVersionError as exc:
            logger.warning("attention back-end module %s refused: %s", module, exc)
        except ImportError as exc:  # absent module or missing optional dependency
            failures.setdefault(module.rsplit(".", 1)[-1], f"{type(exc).__name__}: {exc}")
            # A module that is simply not there is normal; one that fails to import is worth a warning.
            level = logging.DEBUG if getattr(exc, "name", None) == module else logging.WARNING
            logger.log(level, "attention back-end module %s not loaded: %s", module, exc)
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        problem = load_external_backend(entry_point.name, entry_point.load)
        if problem is not None:
            failures.setdefault(entry_point.name, problem)
    return failures


def load_external_backend(name: str, load) -> str | None:
    """Import one external back end (`load()` imports its module or returns its class); failures are logged.

    A class that is returned rather than registered by its module is registered here (with the
    same interface-version check). Returns why it failed, None when it loaded.
    """
    try:
        loaded = load()
        if (isinstance(loaded, type) and issubclass(loaded, AttentionBackend)
                and all(cls.name != loaded.name for cls in _registered())):
            register_backend(loaded)
    except BackendVersionError as exc:
        logger.warning("external attention back end %s refused: %s", name, exc)
    except Exception as exc:  # noqa: BLE001 - a broken plug-in must not stop the engine
        logger.warning("external attention back end %s not loaded: %s", name, exc)
        return f"{type(exc).__name__}: {exc}"
    return None


def _why_unavailable(name: str, failures: dict[str, str]) -> str:
    """Why no registered back end is called `name`: its import failed, or a class of that name
    implements another interface version, else it is not registered."""
    if name in failures:
        return failures[name]
    refused = (interface_compatibility(cls) for cls in _backend_classes() if getattr(cls, "name", None) == name)
    return next((problem for problem in refused if problem is not None), "not registered")


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
    failures = _import_backend_modules()
    candidates = _registered()
    if name != "auto":
        cls = next((c for c in candidates if c.name == name), None)
        if cls is None:
            why = _why_unavailable(name, failures)
            known = ", ".join(c.name for c in candidates)
            raise BackendUnavailableError(
                f"attention back end {name!r} is not available ({why}); available: {known}"
            )
        reason = cls.unsupported_reason(device, dtype, head_dim)
        if reason is not None:
            raise BackendUnavailableError(
                f"attention back end {name!r} cannot run {device.type}/{_dtype_name(dtype)}/head_dim {head_dim}: {reason}"
            )
        logger.info("attention back end: %s (requested) — %s", name, cls.describe())
        return cls()

    skipped = []
    for cls in candidates:
        reason = cls.auto_unsupported_reason(device, dtype, head_dim)
        if reason is None:
            detail = f"; skipped {', '.join(skipped)}" if skipped else ""
            logger.info("attention back end: %s (auto, priority %d%s) — %s", cls.name, cls.priority, detail,
                        cls.describe())
            return cls()
        skipped.append(f"{cls.name}: {reason}")
    raise BackendUnavailableError(
        f"no attention back end supports {device.type}/{_dtype_name(dtype)}/head_dim {head_dim}: "
        + "; ".join(skipped)
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
