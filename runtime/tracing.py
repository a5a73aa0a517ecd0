"""Optional OpenTelemetry request tracing: one trace per engine request, with its phases as spans.

Off by default and free when off: without `--otlp-endpoint`, `build_tracer(None)` returns
`NO_TRACER`, whose `record_request` returns at once, and opentelemetry is never imported. With an
endpoint, opentelemetry-sdk batches spans to an OTLP/HTTP collector (`pip install 'sits[tracing]'`).

Spans are made after the request ends, from the wall-clock timestamps the engine keeps on every
request (`RequestMetrics`, seconds from time.time()), so the engine's step loop does no tracing work:

    sits.request      arrival -> the server holds the final output    (the root span)
      sits.queue      arrival -> first scheduled
      sits.prefill    first scheduled -> first generated token
      sits.decode     first token -> the last step
      sits.detokenize the last step -> the server holds the final output (the last tokens'
                      text; earlier ones are detokenized incrementally during decode)

Attributes follow OpenTelemetry's gen_ai conventions where one exists (`gen_ai.request.model`,
`gen_ai.usage.input_tokens`, ...) plus `sits.tenant`, `sits.track` and `sits.request_id`. Tenants
appear by name only: no API key, header, prompt or generated text is ever put on a span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from sits.runtime.config import ConfigError
from sits.runtime.engine.request import RequestOutput, SamplingParams

SERVICE_NAME = "sits"
TRACES_PATH = "/v1/traces"  # the OTLP/HTTP path a collector serves traces on
PHASES = ("sits.queue", "sits.prefill", "sits.decode", "sits.detokenize")
logger = logging.getLogger("sits.tracing")
INSTALL_HINT = "pip install 'sits[tracing]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"


class RequestTracer:
    """Records finished requests as spans. This base class is the tracer that does nothing."""

    enabled = False

    def record_request(self, request_id: str, tenant: str, params: SamplingParams, output: RequestOutput | None,
                       *, model: str, track: str) -> None:
        """One engine request has ended (finished, aborted or failed); `output` is its last snapshot."""

    def shutdown(self) -> None:
        """Export what is buffered and stop (also done at interpreter exit)."""


NO_TRACER = RequestTracer()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _phases(output: RequestOutput, ended_at: float) -> list[tuple[str, float, float]]:
    """(span name, start, end) in seconds; phases the request never reached are left out, and the
    last one it reached runs until `ended_at` (an aborted request's decode, say)."""
    metrics = output.metrics
    bounds = [metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time, metrics.finished_time,
              ended_at]
    phases = []
    for index, name in enumerate(PHASES):
        start = bounds[index]
        if start is None:
            break
        end = next((bound for bound in bounds[index + 1:] if bound is not None), ended_at)
        start = min(start, ended_at)
        phases.append((name, start, min(max(end, start), ended_at)))
    return phases


def _attributes(request_id: str, tenant: str, params: SamplingParams, output: RequestOutput, model: str,
                track: str) -> dict[str, Any]:
    completions = output.outputs
    reasons = [str(c.finish_reason) for c in completions if c.finish_reason is not None]
    attributes: dict[str, Any] = {
        "sits.request_id": request_id, "sits.tenant": tenant, "sits.track": track,
        "gen_ai.system": SERVICE_NAME, "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": model, "gen_ai.response.model": model,
        "gen_ai.request.temperature": float(params.temperature), "gen_ai.request.top_p": float(params.top_p),
        "gen_ai.request.n": int(params.n),
        "gen_ai.usage.input_tokens": len(output.prompt_token_ids),
        "gen_ai.usage.output_tokens": sum(len(c.token_ids) for c in completions),
        "sits.usage.cached_input_tokens": int(output.metrics.num_cached_prompt_tokens),
    }
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = int(params.max_tokens)
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = int(params.seed)
    if reasons:
        attributes["gen_ai.response.finish_reasons"] = reasons
    return attributes


class OtlpRequestTracer(RequestTracer):
    """Spans through an opentelemetry-sdk TracerProvider of its own (the global one is left alone)."""

    enabled = True

    def __init__(self, span_processors: Sequence[Any], service_name: str = SERVICE_NAME) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        for processor in span_processors:
            self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("sits.runtime")

    @classmethod
    def to_endpoint(cls, endpoint: str, service_name: str = SERVICE_NAME) -> OtlpRequestTracer:
        """Batches spans to the collector at `endpoint` (http[s]://host:port; OTLP/HTTP)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        url = endpoint.rstrip("/")
        if not url.endswith(TRACES_PATH):
            url += TRACES_PATH
        return cls([BatchSpanProcessor(OTLPSpanExporter(endpoint=url))], service_name)

    def record_request(self, request_id: str, tenant: str, params: SamplingParams, output: RequestOutput | None,
                       *, model: str, track: str) -> None:
        if output is None:  # ended before the engine took it: nothing was timed
            return
        try:
            self._record(request_id, tenant, params, output, model, track)
        except Exception:  # tracing must never break a response
            logger.exception("could not record the trace of request %s", request_id)

    def _record(self, request_id: str, tenant: str, params: SamplingParams, output: RequestOutput, model: str,
                track: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        ended_at = time.time()
        root = self._tracer.start_span("sits.request", start_time=_ns(output.metrics.arrival_time),
                                       kind=trace.SpanKind.SERVER,
                                       attributes=_attributes(request_id, tenant, params, output, model, track))
        if not output.finished:
            root.set_status(Status(StatusCode.ERROR, "the request ended before it finished (aborted)"))
        parent = trace.set_span_in_context(root)
        for name, start, end in _phases(output, ended_at):
            self._tracer.start_span(name, context=parent, start_time=_ns(start)).end(end_time=_ns(end))
        root.end(end_time=_ns(ended_at))

    def shutdown(self) -> None:
        self._provider.shutdown()


def build_tracer(otlp_endpoint: str | None, service_name: str = SERVICE_NAME) -> RequestTracer:
    """`NO_TRACER` without an endpoint; else an OTLP tracer. Raises ConfigError naming the flag."""
    if not otlp_endpoint:
        return NO_TRACER
    parts = urlsplit(otlp_endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--otlp-endpoint must be an http(s):// URL of an OTLP/HTTP collector, got {otlp_endpoint!r}")
    try:
        return OtlpRequestTracer.to_endpoint(otlp_endpoint, service_name)
    except ImportError as error:
        raise ConfigError(f"--otlp-endpoint needs OpenTelemetry ({error.name} is missing): {INSTALL_HINT}") from None
