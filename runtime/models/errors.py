"""Errors of model loading, shared by the loaders."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model cannot be loaded: a bad path, a broken checkpoint or an unsupported architecture."""
