"""What a load run measured: requests admitted / refused / failed, TTFT and end-to-end percentiles,
output tokens per second, the server's RSS and leftovers; printed as text, as JSON figures, and as
ratios against a peer run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from benchmarks.load_client import REFUSALS, LoadConfig, Outcome


@dataclass
class ServerSample:
    rss_before_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_after_mb: float | None = None
    drained: bool | None = None  # after the load: no sequence running or waiting, no KV block held
    leftover: dict[str, float] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class LoadReport:
    config: LoadConfig
    outcomes: list[Outcome]
    wall_s: float
    server: ServerSample

    @property
    def admitted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    @property
    def refused(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in REFUSALS]

    @property
    def failures(self) -> list[Outcome]:
        """Anything a healthy server must never answer: 5xx other than a well-formed 503, transport errors."""
        return [o for o in self.outcomes if (o.status >= 500 and o.status != 503) or o.status == 0
                or (o.status == 503 and not o.refusal_ok)]

    @property
    def incomplete(self) -> list[Outcome]:
        """Admitted streams that ended without a finish_reason and [DONE], though the client stayed."""
        return [o for o in self.admitted if not o.complete and not o.disconnected]

    def figures(self) -> dict[str, object]:
        done = [o for o in self.admitted if o.complete]
        ttft = [o.ttft_s for o in done if o.ttft_s is not None]
        e2e = [o.e2e_s for o in done if o.e2e_s is not None]
        statuses: dict[str, int] = {}
        for o in self.outcomes:
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        return {
            "clients": self.config.clients, "duration_s": round(self.wall_s, 1), "requests": len(self.outcomes),
            "admitted": len(self.admitted), "completed": len(done),
            "disconnected": sum(o.disconnected for o in self.admitted),
            "refused": len(self.refused), "refusals_well_formed": all(o.refusal_ok for o in self.refused),
            "failures": len(self.failures), "incomplete": len(self.incomplete), "statuses": statuses,
            **{f"ttft_p{q}_s": _round(percentile(ttft, q)) for q in (50, 95, 99)},
            **{f"e2e_p{q}_s": _round(percentile(e2e, q)) for q in (50, 95, 99)},
            "output_tokens_per_s": round(sum(o.tokens for o in self.admitted) / max(self.wall_s, 1e-9), 1),
            **asdict(self.server),
        }

    def format(self) -> str:
        f = self.figures()
        lines = [
            f"{f['clients']} streaming clients for {f['duration_s']} s against {self.config.url} ({self.config.endpoint}, "
            f"max_tokens {self.config.max_tokens})",
            f"requests {f['requests']}: admitted {f['admitted']} (completed {f['completed']}, dropped by the client "
            f"{f['disconnected']}), refused {f['refused']} (well-formed: {f['refusals_well_formed']}), "
            f"failures {f['failures']}, half-written {f['incomplete']}; statuses {f['statuses']}",
            f"TTFT p50 / p95 / p99: {f['ttft_p50_s']} / {f['ttft_p95_s']} / {f['ttft_p99_s']} s; "
            f"end-to-end p50 / p95 / p99: {f['e2e_p50_s']} / {f['e2e_p95_s']} / {f['e2e_p99_s']} s; "
            f"{f['output_tokens_per_s']} output tok/s",
        ]
        if f["rss_before_mb"] is not None:
            lines.append(f"server RSS: before {f['rss_before_mb']} MB, peak {f['rss_peak_mb']} MB, "
                         f"after {f['rss_after_mb']} MB")
        if f["drained"] is not None:
            lines.append(f"after the load: every sequence ended and every KV block freed: {f['drained']} "
                         f"{f['leftover'] or ''}".rstrip())
        return "\n".join(lines)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def compare(bounded: LoadReport, unbounded: LoadReport) -> str:
    """The bounded server's figures as ratios of its unbounded peer's, measured in the same run."""
    b, u = bounded.figures(), unbounded.figures()

    def ratio(key: str) -> str:
        return "n/a" if not b[key] or not u[key] else f"{b[key] / u[key]:.2f}x"

    growth_b = (b["rss_peak_mb"] or 0) - (b["rss_before_mb"] or 0)
    growth_u = (u["rss_peak_mb"] or 0) - (u["rss_before_mb"] or 0)
    return (f"bounded / unbounded queue: TTFT p50 {ratio('ttft_p50_s')}, p99 {ratio('ttft_p99_s')}; "
            f"e2e p50 {ratio('e2e_p50_s')}, p99 {ratio('e2e_p99_s')}; output tok/s {ratio('output_tokens_per_s')}; "
            f"RSS growth to peak {growth_b:.0f} MB vs {growth_u:.0f} MB")
