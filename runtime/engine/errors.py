"""Errors the engine raises, shaped so the server can map each to an HTTP status.

`ValueError` subclasses are the client's fault (400); the rest say the engine cannot serve right
now (503) or broke (500 / unhealthy).
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine failed to serve a request it had accepted (a bug or a device fault)."""


class EngineDeadError(EngineError):
    """The step loop crashed earlier; the engine accepts no more requests (health check fails)."""


class EngineDiedError(EngineError):
    """The engine's process died while serving the request (a 500; the server then exits)."""


class EngineShuttingDownError(EngineError):
    """The engine is draining or stopped and accepts no new requests (503)."""


class InvalidRequestError(ValueError):
    """A request the engine can never serve as asked (400)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt plus the tokens it asks for do not fit in max_model_len, or the prompt is empty."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is already in the engine."""
