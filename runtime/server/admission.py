"""Admission control at the server's edge: a bounded queue in front of the engine.

The engine runs at most `max_running` sequences at once (`--max-num-seqs`) and queues the rest.
Without a bound, a burst queues without limit: memory grows with every waiting prompt and each
newcomer waits longer than its client will. So the server counts the sequences it has handed to
the engine and not yet seen end (a request with `n` choices over `p` prompts is `n x p`), and
refuses a request that would take the count over `max_running + max_waiting` with
503 + Retry-After in OpenAI's error shape, before the engine sees it: nothing admitted is ever
dropped, nothing refused was ever started. A request that could never fit (more sequences than
the whole capacity) is a 400, not a 503 a client would retry forever.

Per-tenant limits (requests and tokens per minute: 429 with Retry-After) are the tenancy layer's
(`TenantGate`); this bound protects the replica as a whole. When the queue is already full,
`GenerationGate` refuses before the body is even read.

Reservations live in the ASGI request state, so whatever ends a request (response sent, client
gone, error) releases them: `GenerationGate` calls `release` in its `finally`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from sits.runtime.server.errors import OpenAIError, invalid_request

RESERVATION_KEY = "admission"  # in the ASGI scope's state: the request's `Reservation`
WAITING_PER_RUNNING = 1  # the default queue: one full batch waits behind the running one
MIN_WAITING = 32  # ... and never fewer than this many sequences
RETRY_AFTER_MAX_S = 60
DURATION_SMOOTHING = 0.2  # weight of the newest request in the running mean of request durations


@dataclass(frozen=True)
class Reservation:
    """What one request holds of the queue (in its ASGI state under `RESERVATION_KEY`).

    Attributes:
        sequences: engine sequences reserved (choices x prompts), at least 1.
        admitted_at: time.monotonic() of the request's first reservation (its duration's start).
    """

    sequences: int
    admitted_at: float


def default_max_waiting(max_running: int) -> int:
    """The default bound of the waiting queue for an engine that runs `max_running` sequences.

    One batch: under saturation a newcomer then waits about one request's duration for its first
    token; a deeper queue only adds waiting that most clients time out on. At least MIN_WAITING, so an
    engine that runs few sequences (e.g. --max-num-seqs 1) queues a light burst instead of refusing
    it (and its latency, which canary analysis compares, still shows that it is slow).
    """
    return max(WAITING_PER_RUNNING * max_running, MIN_WAITING)


@dataclass
class AdmissionControl:
    """Counts in-flight sequences and refuses requests beyond `max_running + max_waiting`.

    Attributes:
        max_running: sequences the engine runs at once (its max_num_seqs).
        max_waiting: sequences allowed to wait behind them.
        retry_after_s: the shortest Retry-After (seconds) of a 503 when the queue is full; longer
            when the queue ahead takes longer to drain (see `retry_after`).
        in_flight: sequences admitted and not yet ended.
        rejected: requests refused because the queue was full (cumulative).
    """

    max_running: int
    max_waiting: int
    retry_after_s: float = 1.0
    in_flight: int = 0
    rejected: int = 0
    mean_duration_s: float | None = None  # running mean of admitted requests' durations

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be positive, got {self.max_running}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be positive, got {self.retry_after_s}")

    @property
    def capacity(self) -> int:
        """Sequences running plus waiting that the server accepts at once."""
        return self.max_running + self.max_waiting

    @property
    def waiting(self) -> int:
        """Admitted sequences beyond what the engine can run at once (an upper bound of its queue)."""
        return max(self.in_flight - self.max_running, 0)

    @property
    def full(self) -> bool:
        return self.in_flight >= self.capacity

    def overloaded(self) -> OpenAIError:
        """The 503 of a full queue (counted in `rejected`)."""
        self.rejected += 1
        return OpenAIError(
            503, f"The server is at capacity ({self.in_flight} sequences running or queued, at most "
                 f"{self.capacity}); retry after {self.retry_after()} s.",
            code="server_overloaded", headers={"Retry-After": str(self.retry_after())})

    def reserve(self, state: MutableMapping[str, Any], sequences: int, param: str = "n") -> None:
        """Admit `sequences` more for the request whose ASGI state this is, or raise OpenAIError.

        Raises a 400 naming `param` when the request alone exceeds the capacity, and the 503 of
        `overloaded()` when the others leave no room for it now.
        """
        sequences = max(int(sequences), 1)
        if sequences > self.capacity:
            raise invalid_request(
                f"The request asks for {sequences} sequences (choices x prompts); this server runs or "
                f"queues at most {self.capacity} at once.", param=param, code="too_many_sequences")
        if self.in_flight + sequences > self.capacity:
            raise self.overloaded()
        self.in_flight += sequences
        held: Reservation | None = state.get(RESERVATION_KEY)
        state[RESERVATION_KEY] = Reservation(sequences, time.monotonic()) if held is None else Reservation(
            held.sequences + sequences, held.admitted_at)

    def release(self, state: MutableMapping[str, Any]) -> None:
        """Give back what the request whose ASGI state this is reserved (idempotent)."""
        held: Reservation | None = state.pop(RESERVATION_KEY, None)
        if held is not None:
            self.in_flight = max(self.in_flight - held.sequences, 0)
            duration = time.monotonic() - held.admitted_at
            previous = self.mean_duration_s
            self.mean_duration_s = duration if previous is None else (
                previous + DURATION_SMOOTHING * (duration - previous))

    def retry_after(self) -> int:
        """Seconds until the queue has likely room again: the batches ahead times a request's mean duration.

        At least `retry_after_s`, at most a minute; clients that honour it (the openai client does)
        come back when they can be admitted instead of spinning on 503s.
        """
        estimate = self.retry_after_s
        if self.mean_duration_s is not None:
            batches_ahead = (self.in_flight - self.max_running) / self.max_running
            estimate = max(estimate, self.mean_duration_s * max(batches_ahead, 0.0))
        return int(min(max(1, math.ceil(estimate)), RETRY_AFTER_MAX_S))


class AdmissionCollector:
    """Prometheus view of an AdmissionControl, read at scrape time."""

    def __init__(self, admission: AdmissionControl, model: str, track: str) -> None:
        self._admission = admission
        self._labels = (model, track)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        admission, labels = self._admission, ("model", "track")
        for name, doc, value in (
                ("sits_admission_in_flight", "Sequences admitted to the engine and not yet ended.", admission.in_flight),
                ("sits_admission_capacity", "Sequences running or queued that the server admits at once.",
                 admission.capacity)):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(self._labels, float(value))
            yield gauge
        rejected = CounterMetricFamily("sits_admission_rejected", "Requests refused with 503 because the queue "
                                       "was full.", labels=labels)
        rejected.add_metric(self._labels, float(admission.rejected))
        yield rejected
