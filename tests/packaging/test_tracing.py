"""Request tracing: off and free by default; with a tracer, real requests leave their phases as spans.

The traced server is the real app (a tiny random Llama on CPU, API keys from examples/tenants.yaml)
under uvicorn, called with the official openai client; spans go to OpenTelemetry's in-memory
exporter. One test sends spans through the real OTLP/HTTP exporter to a receiver on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sits.runtime.cli import main as sits_main
from sits.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from sits.runtime.engine.async_engine import AsyncEngine
from sits.runtime.engine.request import (
    CompletionOutput,
    FinishReason,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from sits.runtime.server.app import build_app
from sits.runtime.server.runner import BackgroundServer
from sits.runtime.tenancy.config import TenancyConfig
from sits.runtime.tenancy.server_auth import TenancyResolver
from sits.runtime.tenancy.service import Tenancy
from sits.runtime.tracing import NO_TRACER, PHASES, OtlpRequestTracer, build_tracer

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-finance-example"  # the finance tenant's key in examples/tenants.yaml
PROMPT = "The lighthouse keeper wrote"


@pytest.fixture(scope="module")
def traced(tiny_llama_dir: Path) -> Iterator[tuple[BackgroundServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    config = EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), device="cpu"), cache=CacheConfig(num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    engine = AsyncEngine.from_config(config, progress=False)
    tenancy = Tenancy.from_config(TenancyConfig(tenants_file=str(ROOT / "examples" / "tenants.yaml")))
    app = build_app(engine, ServerConfig(track="canary"),
                    tenant_resolver=TenancyResolver(tenancy.authenticator, tenancy.limiter))
    app.state.ctx.tracer = OtlpRequestTracer([SimpleSpanProcessor(exporter)])
    with BackgroundServer(app) as server:
        yield server, exporter


@pytest.fixture
def client(traced) -> openai.OpenAI:
    server, exporter = traced
    exporter.clear()
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def trace_of(exporter: InMemorySpanExporter, request_id: str) -> tuple[object, list]:
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "sits.request" and s.attributes["sits.request_id"] == request_id]
    children = sorted((s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
                      key=lambda s: s.start_time)
    return root, children


def test_a_completion_leaves_a_request_span_with_queue_prefill_decode_and_detokenize(client, traced):
    _, exporter = traced
    completion = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    root, children = trace_of(exporter, completion.id)
    assert [s.name for s in children] == list(PHASES)
    assert all(s.context.trace_id == root.context.trace_id for s in children)
    # the phases tile the request: each starts where the previous one ended
    assert children[0].start_time == root.start_time and children[-1].end_time == root.end_time
    for before, after in zip(children, children[1:], strict=False):
        assert before.end_time == after.start_time and before.start_time <= before.end_time
    attributes = root.attributes
    assert attributes["sits.tenant"] == "finance" and attributes["sits.track"] == "canary"
    assert attributes["gen_ai.request.model"] == completion.model
    assert attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens == 6
    assert attributes["gen_ai.request.max_tokens"] == 6 and attributes["gen_ai.request.temperature"] == 0.0
    assert list(attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert root.status.is_ok and root.resource.attributes["service.name"] == "sits"


def test_a_streamed_chat_is_traced_too(client, traced):
    _, exporter = traced
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
    root, children = trace_of(exporter, chunks[0].id)
    assert [s.name for s in children] == list(PHASES)
    assert root.attributes["gen_ai.usage.output_tokens"] == 4


def test_no_key_header_or_text_ever_lands_on_a_span(client, traced):
    _, exporter = traced
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
                                   extra_headers={"x-api-key": API_KEY, "x-sits-tenant": "research"})
    spans = exporter.get_finished_spans()
    assert spans
    everything = " ".join(span.to_json() for span in spans)
    for secret in (API_KEY, hashlib.sha256(API_KEY.encode()).hexdigest(), "Bearer", "authorization", PROMPT):
        assert secret.lower() not in everything.lower(), f"{secret!r} reached a span"
    assert {span.attributes.get("sits.tenant") for span in spans if span.name == "sits.request"} == {"finance"}


def aborted_output() -> RequestOutput:
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0)
    return RequestOutput(request_id="r", prompt_token_ids=[1, 2, 3], finished=False, metrics=metrics,
                         outputs=[CompletionOutput(index=0, token_ids=[7, 8], finish_reason=None)])


def test_an_aborted_request_ends_its_trace_in_decode_with_an_error_status(monkeypatch):
    exporter = InMemorySpanExporter()
    tracer = OtlpRequestTracer([SimpleSpanProcessor(exporter)])
    monkeypatch.setattr("sits.runtime.tracing.time.time", lambda: 102.0)
    tracer.record_request("r", "beta", SamplingParams(max_tokens=100), aborted_output(), model="m", track="stable")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"sits.request", "sits.queue", "sits.prefill", "sits.decode"}
    assert (spans["sits.decode"].start_time, spans["sits.decode"].end_time) == (101_000_000_000, 102_000_000_000)
    assert not spans["sits.request"].status.is_ok
    assert "gen_ai.response.finish_reasons" not in spans["sits.request"].attributes
    done = aborted_output()
    done.finished, done.metrics.finished_time = True, 101.8
    done.outputs[0].finish_reason = FinishReason.STOP
    tracer.record_request("r", "beta", SamplingParams(), done, model="m", track="stable")
    tracer.record_request("never-ran", "beta", SamplingParams(), None, model="m", track="stable")  # nothing to show
    assert len(exporter.get_finished_spans()) == 4 + 5


def test_off_by_default_the_tracer_is_a_no_op_and_opentelemetry_sdk_is_never_imported():
    # FastAPI itself imports opentelemetry's API; the SDK and the exporter come only with an endpoint
    code = ("import sys\n"
            "import sits.runtime.server.app\n"
            "before = {m for m in sys.modules if m.startswith('opentelemetry')}\n"
            "from sits.runtime.cli import build_parser\n"
            "from sits.runtime.tracing import NO_TRACER, build_tracer\n"
            "args = build_parser().parse_args(['serve'])\n"
            "assert build_tracer(args.otlp_endpoint) is NO_TRACER\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry') and m not in before))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["[]", "[]"]
    assert NO_TRACER.enabled is False and NO_TRACER.record_request("r", "t", SamplingParams(), None, model="m",
                                                                    track="stable") is None


def test_a_bad_endpoint_or_a_missing_package_is_a_one_line_error(capsys, monkeypatch):
    assert sits_main(["serve", "--device", "cpu", "--otlp-endpoint", "otel-collector:4317"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sits serve: error: --otlp-endpoint must be an http(s):// URL") and "\n" not in err
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(ValueError, match=r"--otlp-endpoint needs OpenTelemetry .*pip install 'sits\[tracing\]'"):
        build_tracer("http://127.0.0.1:4318")


class _Receiver(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append((self.path, self.headers.get("Content-Type", ""), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_with_an_endpoint_spans_reach_an_otlp_http_collector():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tracer = build_tracer(f"http://127.0.0.1:{server.server_address[1]}")
        assert tracer.enabled
        done = aborted_output()
        done.finished, done.metrics.finished_time = True, 101.8
        tracer.record_request("otlp-request", "beta", SamplingParams(), done, model="m", track="stable")
        tracer.shutdown()  # flushes the batch
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    (path, content_type, body), *_ = _Receiver.received
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    assert b"otlp-request" in body and b"sits.decode" in body
