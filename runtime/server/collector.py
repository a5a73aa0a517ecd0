"""The base of the server's custom Prometheus collectors: read a live object when /metrics is scraped."""

from __future__ import annotations

from typing import Any


class ScrapeCollector:
    """A prometheus_client custom collector labelled (model, track); subclasses implement `collect()`,
    adding `self._labels` as each family's label values.

    Args:
        model: the served model's name (the `model` label).
        track: this replica's rollout track (the `track` label).
    """

    def __init__(self, model: str, track: str) -> None:
        self._labels = (model, track)

    def describe(self) -> list[Any]:
        """Nothing: the registry then reads no state when the collector is registered."""
        return []
