"""The FastAPI app: OpenAI-compatible routes, health, metrics, and the engine's start and stop.

`build_app(engine, server_config)` wires the parts around an `EngineClient`; nothing here is module-global, so several apps
(with their own engines and metric registries) can live in one process.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sits.runtime.config import ServerConfig
from sits.runtime.engine.client import EngineClient
from sits.runtime.server.admission import AdmissionCollector, AdmissionControl, default_max_waiting
from sits.runtime.server.chat import ChatCompletions
from sits.runtime.server.completions import Completions
from sits.runtime.server.errors import install_error_handlers
from sits.runtime.server.grammar_compiler import GrammarCompileCollector, GrammarCompiler
from sits.runtime.server.lifecycle import Lifecycle
from sits.runtime.server.lora_routes import install_lora_routes
from sits.runtime.server.metrics import ServerMetrics
from sits.runtime.server.metrics_access import api_docs_urls, install_metrics_route, public_model_root
from sits.runtime.server.middleware import BodySizeLimit, GenerationGate
from sits.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from sits.runtime.server.security import ServerSecurity
from sits.runtime.server.serving import ServingContext
from sits.runtime.server.tenant import (
    SingleTenantResolver,
    TenantGate,
    TenantResolver,
    request_allowed_models,
    request_tenant,
)
from sits.runtime.server.tokenize import DetokenizeRequest, Tokenization, TokenizeRequest, installed_version
from sits.runtime.server.tokenizer_info import install_tokenizer_info_route
from sits.runtime.tenancy.server_auth import TenancyResolver
from sits.runtime.tenancy.service import Tenancy

logger = logging.getLogger("sits.server")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # far above any prompt that fits a context window
GENERATION_PATHS = {"/v1/chat/completions", "/v1/completions"}


def build_app(engine: EngineClient, server_config: ServerConfig | None = None, *,
              served_model_name: str | None = None, tenant_resolver: TenantResolver | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, manage_engine: bool = True,
              usage_observer: Callable[[str, int, int], None] | None = None, tenancy: Tenancy | None = None,
              max_waiting_requests: int | None = None, retry_after_s: float = 1.0,
              security: ServerSecurity | None = None) -> FastAPI:
    """The server app around an engine (in this process or in its own: any `EngineClient`).

    Args:
        engine: the engine (started and shut down with the app when manage_engine).
        server_config: track label and drain timeout; host/port are the runner's business.
        served_model_name: the OpenAI model id; defaults to the engine's model name.
        tenant_resolver: decides each request's tenant (default: everyone is "default").
        max_body_bytes: larger request bodies get 413.
        usage_observer: called as (tenant, prompt_tokens, output_tokens) after each engine request.
        tenancy: a `sits.runtime.tenancy.service.Tenancy` (API keys, limits, salts, usage, its
            metrics), started and closed with the app; it provides the resolver and usage observer
            unless those are given. The engine should have been built with its engine-side hooks.
        max_waiting_requests: sequences that may wait behind the engine's running batch; more get
            503 + Retry-After (`sits.runtime.server.admission`). None: the engine's max_num_seqs, at least 32.
        retry_after_s: the Retry-After of those 503s.
        security: grammar-compile bounds, HTTP limits, the metrics port, LoRA roots, API docs
            (`sits.runtime.server.security`; docs/security.md). None: the defaults.
    """
    config = server_config or ServerConfig()
    model_name = served_model_name or engine.model_name
    if tenancy is not None:
        tenant_resolver = tenant_resolver or TenancyResolver.for_tenancy(tenancy)
    admission = _admission(engine, max_waiting_requests, retry_after_s)
    ctx = _serving_context(engine, model_name, config.track, tenancy, usage_observer, admission)
    metrics, lifecycle = ctx.metrics, ctx.lifecycle
    security = security or ServerSecurity()
    tenants_mode = tenancy is not None and tenancy.config.tenants_file is not None
    grammar_compiler = GrammarCompiler(engine.grammar_cache, security.grammar)
    metrics.register(GrammarCompileCollector(grammar_compiler, model_name, config.track))

    app = FastAPI(title="SITS", summary="OpenAI-compatible LLM serving",
                  lifespan=_lifespan(engine, tenancy, grammar_compiler, manage_engine),
                  **api_docs_urls(security.api_docs, tenants_mode))
    app.state.security = security
    app.state.grammar_compiler = grammar_compiler
    app.state.ctx = ctx
    app.state.lifecycle = lifecycle
    app.state.metrics = metrics
    app.state.server_config = config
    app.state.tenant_resolver = tenant_resolver or SingleTenantResolver()
    app.state.admission = admission
    install_error_handlers(app)
    _install_middleware(app, ctx, admission, max_body_bytes)
    chat = ChatCompletions(ctx, tool_call_parser=config.auto_tool_call_parser)
    _install_generation_routes(app, ctx, chat)
    _install_model_routes(app, ctx, engine)
    # --allow-runtime-lora-updating: /v1/load_lora_adapter and /v1/unload_lora_adapter (else no such routes)
    install_lora_routes(app, engine, model_name, tenancy, metrics, config.track)
    _install_utility_routes(app, ctx, chat)
    _install_health_routes(app, engine, lifecycle)
    install_metrics_route(app, metrics.exposition, tenants_mode=tenants_mode, metrics_port=security.metrics_port)
    return app


def _serving_context(engine: EngineClient, model_name: str, track: str, tenancy: Tenancy | None,
                     usage_observer: Callable[[str, int, int], None] | None,
                     admission: AdmissionControl) -> ServingContext:
    """The handlers' context: metrics (with the tenancy's and the admission's collectors), the
    lifecycle, and the tenancy's usage and prompt observers (unless `usage_observer` is given)."""
    metrics = ServerMetrics(model_name, track, engine.stats)
    prompt_observer = None
    if tenancy is not None:
        usage_observer = usage_observer or tenancy.observe_usage
        prompt_observer = tenancy.observe_prompt
        metrics.register(tenancy.collector(model_name, track))
    metrics.register(AdmissionCollector(admission, model_name, track))
    ctx = ServingContext(engine=engine, model_name=model_name, metrics=metrics, lifecycle=Lifecycle(),
                         usage_observer=usage_observer, prompt_observer=prompt_observer, admission=admission)
    ctx.max_prompt_chars  # noqa: B018 - read once from the vocabulary now, not on the first request
    if tenancy is not None:
        tenancy.warn_unserved_models(ctx.served_models)  # tenants' allow-lists naming models not served here
    return ctx


def _install_middleware(app: FastAPI, ctx: ServingContext, admission: AdmissionControl, max_body_bytes: int) -> None:
    # Innermost first: the tenant gate answers 401 / 503 (queue full) / 429 before the body is read,
    # inside the generation gate, which counts those answers under the request's tenant.
    app.add_middleware(TenantGate, generation_paths=GENERATION_PATHS, admission=admission)
    app.add_middleware(GenerationGate, lifecycle=ctx.lifecycle, metrics=ctx.metrics, paths=GENERATION_PATHS,
                       admission=admission)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)


def _lifespan(engine: EngineClient, tenancy: Tenancy | None, grammar_compiler: GrammarCompiler,
              manage_engine: bool) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if tenancy is not None:
            await tenancy.start()  # never raises for an unreachable Redis: it serves from local state
        try:
            if manage_engine:
                await engine.start()
            await grammar_compiler.prepare()  # xgrammar's vocabulary view: once, before serving
            try:
                yield
            finally:
                if manage_engine:
                    await engine.shutdown(0.0)
        finally:
            await grammar_compiler.close()
            if tenancy is not None:
                await tenancy.close()  # writes the last usage and retires this replica's state

    return lifespan


def _install_generation_routes(app: FastAPI, ctx: ServingContext, chat: ChatCompletions) -> None:
    completions = Completions(ctx)

    # A tenant's `models` allow-list is checked first by each handler (`input_processor.open_request`): a
    # model kept from the tenant is the same 404 as one that does not exist, before any work (no stream starts).
    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                     tenant: str = Depends(request_tenant)) -> Response:
        return await chat(body, tenant, request)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request,
                                tenant: str = Depends(request_tenant)) -> Response:
        return await completions(body, tenant, request)


def _install_model_routes(app: FastAPI, ctx: ServingContext, engine: EngineClient) -> None:
    created = int(time.time())

    def model_card(model_id: str) -> dict[str, Any]:
        """As vLLM lists models: `root` is where the weights came from; a LoRA adapter's `parent` is its base."""
        card = {"id": model_id, "object": "model", "created": created, "owned_by": "sits",
                "root": public_model_root(engine.model_info.source, ctx.model_name), "parent": None,
                "max_model_len": engine.max_model_len}
        adapter = ctx.lora_modules.get(model_id) if model_id != ctx.model_name else None
        if adapter is not None:
            card.update(root=public_model_root(adapter.path, model_id),
                        parent=adapter.base_model_name or ctx.model_name)
        return card

    # Listing models needs a key too (TenantGate covers every /v1/* path), as OpenAI's API does.
    @app.get("/v1/models", dependencies=[Depends(request_tenant)])
    async def list_models(request: Request) -> dict[str, Any]:
        allowed = request_allowed_models(request)
        return {"object": "list", "data": [model_card(model_id) for model_id in ctx.served_models
                                           if allowed is None or model_id in allowed]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(request_tenant)])
    async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
        ctx.check_model(model_id, request_allowed_models(request))  # 404: neither served nor the tenant's
        return model_card(model_id)


def _install_utility_routes(app: FastAPI, ctx: ServingContext, chat: ChatCompletions) -> None:
    # vLLM's utility endpoints: with tenants /tokenize and /detokenize need a key (TenantGate covers
    # them), but they run no engine work, so no rate limit or admission applies.
    tokenization = Tokenization(ctx, chat)
    version = {"version": installed_version()}

    @app.post("/tokenize", dependencies=[Depends(request_tenant)])
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        return await tokenization.tokenize(body, request_allowed_models(request))

    @app.post("/detokenize", dependencies=[Depends(request_tenant)])
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        return await tokenization.detokenize(body, request_allowed_models(request))

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return version

    install_tokenizer_info_route(app, ctx)  # GET /tokenizer_info (lm-eval's remote tokenizer)


def _install_health_routes(app: FastAPI, engine: EngineClient, lifecycle: Lifecycle) -> None:
    def readiness() -> JSONResponse:
        if lifecycle.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.is_healthy:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        if not engine.is_accepting:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    async def health() -> JSONResponse:
        """Readiness: 503 while draining or when the engine is unhealthy (take this replica out)."""
        return readiness()

    @app.get("/health/ready")
    async def health_ready() -> JSONResponse:
        return readiness()

    @app.get("/health/live")
    async def health_live() -> JSONResponse:
        """Liveness: 503 only when the engine is dead (restart this replica); draining is alive."""
        if not engine.is_healthy:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})


def _admission(engine: EngineClient, max_waiting: int | None, retry_after_s: float) -> AdmissionControl:
    """The bounded queue for this engine, sized from its max_num_seqs."""
    max_running = engine.model_info.max_num_seqs
    waiting = default_max_waiting(max_running) if max_waiting is None else max_waiting
    return AdmissionControl(max_running=max_running, max_waiting=waiting, retry_after_s=retry_after_s)
