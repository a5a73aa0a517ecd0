"""The figures of `sits bench serve`, computed from per-request records as `vllm bench serve` defines them.

Per request (all times in seconds on the client's monotonic clock, `time.perf_counter`):
  - TTFT: from sending the request to the first streamed chunk that carries output;
  - E2E latency (E2EL): from sending the request to the end of its response;
  - TPOT (time per output token, excluding the first): (E2EL - TTFT) / (output_tokens - 1), for
    requests with more than one output token;
  - ITL (inter-token latency): the gaps between successive output chunks of one stream (a chunk
    that carries several tokens is one gap, as vLLM counts it); every request's gaps are pooled.
Over the run (duration: from the first request sent to the last response's end):
  - request throughput = successful requests / duration; output tok/s = output tokens / duration;
    total tok/s = (prompt + output tokens) / duration;
  - goodput = successful requests within every given SLO (`--goodput ttft:MS tpot:MS e2el:MS`,
    each bound inclusive, milliseconds) / duration, in requests per second;
  - percentiles interpolate linearly between closest ranks (numpy's default), median = p50.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50.0, 90.0, 99.0)
PREFIX_QUERIES = "sits_prefix_cache_queries_total"
PREFIX_HITS = "sits_prefix_cache_hits_total"
PREEMPTIONS = "sits_preemptions_total"
ENGINE_STEPS = "sits_engine_steps_total"
ENGINE_CPU = "sits_engine_cpu_seconds_total"
SERVER_CPU = "process_cpu_seconds_total"  # the process that answers /metrics: the API server's
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


@dataclass
class RequestRecord:
    """One request as the client saw it.

    Attributes:
        sent_s: when the request left (perf_counter seconds).
        chunk_times_s: when each chunk that carried output arrived (perf_counter seconds).
        end_s: when the response ended (or failed).
        prompt_tokens, output_tokens: the server's usage when it sent one, else what the client
            knows (the prompt it built; the output chunks it counted).
        status: the HTTP status (200 on success); 0 for a connection error.
        error: why it failed ("" on success).
        tenant: the tenant whose key it carried ("" without tenants).
    """

    sent_s: float
    end_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    status: int = 0
    error: str = ""
    tenant: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def ttft_s(self) -> float:
        return (self.chunk_times_s[0] if self.chunk_times_s else self.end_s) - self.sent_s

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def parse_goodput(values: Sequence[str] | None) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` → {"ttft": seconds, ...}; ValueError naming the bad item."""
    slos: dict[str, float] = {}
    for item in values or ():
        key, sep, number = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: {item!r} is not KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
        try:
            ms = float(number)
        except ValueError:
            raise ValueError(f"--goodput: {item!r}: {number!r} is not a number of milliseconds") from None
        if not ms > 0 or not math.isfinite(ms):
            raise ValueError(f"--goodput: {item!r}: the bound must be a positive number of milliseconds")
        slos[key] = ms / 1000.0
    return slos


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks as numpy.percentile; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 of seconds, in milliseconds (NaN when empty)."""
    mean = sum(values) / len(values) if values else math.nan
    out = {"mean": mean * 1000.0}
    out.update({("median" if q == 50.0 else f"p{q:g}"): percentile(values, q) * 1000.0 for q in PERCENTILES})
    return out


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    measured = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}
    return all(measured[key] <= bound for key, bound in slos.items())


def parse_prometheus(text: str) -> dict[str, float]:
    """The sum over label sets of every sample in a Prometheus text exposition, by metric name."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        sums[match.group(1)] = sums.get(match.group(1), 0.0) + value
    return sums


def server_counters(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """What the server counted during the run, from /metrics read before and after; None (reported n/a)
    where the server does not export it: prefix-cache hit rate (hit prompt tokens / queried prompt tokens),
    preemptions, engine steps, and CPU seconds of the engine's process and of the API server's (SITS names
    the first three, prometheus_client the last)."""
    def delta(name: str) -> float | None:
        if before is None or after is None or name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    queries, hits, preemptions = delta(PREFIX_QUERIES), delta(PREFIX_HITS), delta(PREEMPTIONS)
    rate = hits / queries if queries and hits is not None else None
    return {"prefix_cache_hit_rate": rate, "prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": queries,
            "preemptions": preemptions, "engine_steps": delta(ENGINE_STEPS), "engine_cpu_s": delta(ENGINE_CPU),
            "server_cpu_s": delta(SERVER_CPU)}


def load_figures(records: Sequence[RequestRecord], duration_s: float,
                 counters: dict[str, float | None]) -> dict[str, float | None]:
    """Where a run's time went, to tell a slow engine from a busy API server or client:
      - output_tokens_per_chunk: output tokens / output chunks the client received (above 1 where the server
        sent several tokens in one chunk: its API process fell behind the engine, or speculation);
      - mean_engine_step_ms: the run's duration / engine steps during it (a step's GPU and host time together);
      - engine_cpu_cores, server_cpu_cores: CPU seconds / duration of the engine's process and of the API
        server's (1.0: one core busy all the run; the API server's loop runs on one).
    None where a figure is missing (a server without these series, no chunk)."""
    chunks = sum(len(r.chunk_times_s) for r in records)
    steps, engine_cpu, server_cpu = counters.get("engine_steps"), counters.get("engine_cpu_s"), counters.get("server_cpu_s")
    duration = max(duration_s, 1e-9)
    return {
        "output_tokens_per_chunk": sum(r.output_tokens for r in records) / chunks if chunks else None,
        "mean_engine_step_ms": 1000.0 * duration / steps if steps else None,
        "engine_cpu_cores": engine_cpu / duration if engine_cpu is not None else None,
        "server_cpu_cores": server_cpu / duration if server_cpu is not None else None,
    }


def compute_report(records: Iterable[RequestRecord], duration_s: float, slos: dict[str, float],
                   counters: dict[str, float | None]) -> dict[str, Any]:
    """Every figure of the run as a JSON-ready dict (latencies in ms, rates per second)."""
    records = list(records)
    done = [r for r in records if r.ok]
    failed = Counter(str(r.status) if r.status else "connection" for r in records if not r.ok)
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    duration = max(duration_s, 1e-9)
    report: dict[str, Any] = {
        "duration_s": duration_s, "completed": len(done), "failed": sum(failed.values()),
        "failed_by_status": dict(sorted(failed.items())),
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": summary_ms([r.ttft_s for r in done]),
        "tpot_ms": summary_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": summary_ms([gap for r in done for gap in r.itl_s]),
        "e2el_ms": summary_ms([r.e2el_s for r in done]),
        **counters,
        **load_figures(done, duration_s, counters),
    }
    if slos:
        good = sum(1 for r in done if meets_slos(r, slos))
        report["goodput_slos_ms"] = {key: value * 1000.0 for key, value in slos.items()}
        report["good_requests"] = good
        report["request_goodput"] = good / duration
    return report


def _number(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def format_report(report: dict[str, Any]) -> str:
    """The result table, laid out as `vllm bench serve` prints it (plus p90, failures by status, server counters)."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<44}{value:>16}")

    row("Successful requests:", str(report["completed"]))
    row("Failed requests:", str(report["failed"]))
    for status, count in report["failed_by_status"].items():
        row(f"  HTTP {status}:" if status != "connection" else "  connection errors:", str(count))
    row("Benchmark duration (s):", _number(report["duration_s"]))
    row("Total input tokens:", str(report["total_input_tokens"]))
    row("Total generated tokens:", str(report["total_output_tokens"]))
    row("Request throughput (req/s):", _number(report["request_throughput"]))
    if "request_goodput" in report:
        row("Request goodput (req/s):", _number(report["request_goodput"]))
    row("Output token throughput (tok/s):", _number(report["output_throughput"]))
    row("Total Token throughput (tok/s):", _number(report["total_token_throughput"]))
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append("{s:{c}^60}".format(s=title, c="-"))
        short = key.split("_")[0].upper()
        for stat, value in report[key].items():
            name = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            row(f"{name} {short} (ms):", _number(value))
    lines.append("{s:{c}^60}".format(s="Server (/metrics, during the run)", c="-"))
    rate = report["prefix_cache_hit_rate"]
    row("Prefix cache hit rate (%):", _number(rate * 100.0 if rate is not None else None))
    row("Preemptions:", _number(report["preemptions"], 0))
    row("Engine steps:", _number(report["engine_steps"], 0))
    row("Mean engine step (ms):", _number(report["mean_engine_step_ms"]))
    row("Engine process CPU (cores):", _number(report["engine_cpu_cores"]))
    row("API server CPU (cores):", _number(report["server_cpu_cores"]))
    row("Output tokens per chunk:", _number(report["output_tokens_per_chunk"]))
    lines.append("=" * 60)
    return "\n".join(lines)


def to_json(report: dict[str, Any], setup: dict[str, Any], records: Sequence[RequestRecord]) -> str:
    """The report, the run's setup and every request's record (NaN written as null)."""
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean({"setup": setup, "results": report, "requests": [asdict(r) for r in records]}), indent=1)
