"""`SnapshotCollector`: the one shape of SITS's Prometheus collectors that read a snapshot per scrape.

A collector is given a callable that returns its snapshot (`EngineStats`, `TenancySnapshot`) and
calls it once per scrape; it never reaches into what the snapshot describes. Every series carries
the server's `model` and `track` labels, and a per-tenant series a `tenant` label between them
(`LABELS`), so they line up with the server's own histograms. Subclasses list their families in
`FAMILIES` (what `describe` declares, without values, so registering never calls the source) and
build them in `collect` with `_per_tenant` and `_single`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar, Generic, TypeVar

from prometheus_client.core import Metric

LABELS = ("model", "tenant", "track")
SERVER_LABELS = ("model", "track")

Snapshot = TypeVar("Snapshot")


class SnapshotCollector(Generic[Snapshot]):
    """A prometheus_client custom collector over one snapshot per scrape.

    Args:
        source: returns the current snapshot (called once per scrape, from the scraping thread).
        model, track: the server's labels.
    """

    # (family class, series name, label names) of every family `collect` may yield
    FAMILIES: ClassVar[tuple[tuple[type, str, tuple[str, ...]], ...]] = ()

    def __init__(self, source: Callable[[], Snapshot], model: str, track: str) -> None:
        self._source = source
        self._model = model
        self._track = track

    def describe(self) -> list[Metric]:
        return [kind(name, "", labels=labels) for kind, name, labels in self.FAMILIES]

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._source())

    def _families(self, snapshot: Snapshot) -> Iterator[Metric]:
        raise NotImplementedError

    def _per_tenant(self, kind: type, name: str, doc: str, values: Mapping[str, float]) -> Metric:
        """One series per tenant, in tenant order."""
        family = kind(name, doc, labels=LABELS)
        for tenant, value in sorted(values.items()):
            family.add_metric([self._model, tenant, self._track], float(value))
        return family

    def _single(self, kind: type, name: str, doc: str, value: float) -> Metric:
        """One series for the whole server (model and track labels only)."""
        family = kind(name, doc, labels=SERVER_LABELS)
        family.add_metric([self._model, self._track], float(value))
        return family
